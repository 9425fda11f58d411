"""Turns of a worker's episode: the extension field, the stitched stream, the bridge."""

from __future__ import annotations

import pytest

from colonnade.engine import Episode, SamplingParams
from colonnade.protocol.turns import chat_prompt
from colonnade.serve.episodes import Episodes, bridge
from colonnade.serve.requests import EPISODE_FIELD, SPENT, RequestError, Served, chat_job

KEY = bytes(32)
CHAT = [{"role": "user", "content": "the quick brown fox"}]


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny[1]


def _turn(tokens: list[int], finish: str = "length") -> Episode:
    return Episode([], 0, list(tokens), [True] * len(tokens), [-0.5] * len(tokens),
                   [0.25] * len(tokens), finish=finish)  # fmt: skip


def test_only_an_endpoint_with_episodes_reads_the_field(tok):
    body = {"messages": CHAT, EPISODE_FIELD: "x"}
    public = Served("tiny", SamplingParams())
    with pytest.raises(RequestError, match=f"unsupported field '{EPISODE_FIELD}'"):
        chat_job(body, tok, public)
    worker = Served("tiny", SamplingParams(), episodes=Episodes(tok))
    with pytest.raises(RequestError, match="no open episode"):
        chat_job(body, tok, worker)


def test_turns_take_the_episodes_key_positions_and_budget(tok):
    episodes = Episodes(tok)
    handle = episodes.open(KEY, budget=40)
    served = Served("tiny", SamplingParams(), episodes=episodes)
    first = chat_job({"messages": CHAT, EPISODE_FIELD: handle, "max_tokens": 30}, tok, served)
    assert first.keys() == [KEY] and first.origin == 0
    assert first.limits.max_episode_tokens == 30
    with pytest.raises(RequestError, match="one completion, without a seed"):
        chat_job({"messages": CHAT, EPISODE_FIELD: handle, "seed": 1}, tok, served)
    reply = tok.encode(" brown fox", add_special_tokens=False)
    episodes.record(handle, first.prompts[0], _turn(reply), " brown fox")
    history = [*CHAT, {"role": "assistant", "content": " brown fox"},
               {"role": "user", "content": "again"}]  # fmt: skip
    second = chat_job({"messages": history, EPISODE_FIELD: handle, "max_tokens": 30}, tok, served)
    added = len(second.prompts[0]) - len(first.prompts[0]) - len(reply)
    assert second.origin == len(reply) + added  # the draws go on where the episode is
    assert second.limits.max_episode_tokens == 40 - len(reply) - added  # the budget left
    episodes.record(handle, second.prompts[0], _turn([5] * (40 - len(reply) - added)), "x")
    history += [{"role": "assistant", "content": "x"}, {"role": "user", "content": "more"}]
    with pytest.raises(RequestError, match=SPENT):
        chat_job({"messages": history, EPISODE_FIELD: handle}, tok, served)
    ep = episodes.close(handle)
    mask = [True] * len(reply) + [False] * added + [True] * (40 - len(reply) - added)
    assert ep.from_model == mask and ep.logprobs.count(0.0) == added and ep.broken is None


def test_the_bridge_keeps_the_sampled_tokens_where_the_text_encodes_otherwise(tok):
    prompt = chat_prompt(tok, CHAT)
    text = " brown fox"
    canonical = tok.encode(text, add_special_tokens=False)
    # The same text in single bytes: what a model may sample, not what the
    # template's encoding gives back.
    spelled = [t for ch in text for t in tok.encode(ch, add_special_tokens=False)]
    assert spelled != canonical and tok.decode(spelled) == text
    later = chat_prompt(tok, [*CHAT, {"role": "assistant", "content": text},
                              {"role": "tool", "content": "42"}])  # fmt: skip
    stream = prompt + spelled
    bridged = bridge(tok, stream, len(prompt), text, later)
    assert bridged[: len(stream)] == stream
    assert tok.decode(bridged) == tok.decode(later)  # the same text, the sampled tokens
    # A reply cut before its stop string: the stop string's tokens stay the model's.
    stopped = prompt + canonical + tok.encode("</answer>", add_special_tokens=False)
    bridged = bridge(tok, stopped, len(prompt), text, later)
    assert bridged[: len(stopped)] == stopped and tok.decode(bridged).endswith("assistant\n")
    # A next prompt that does not go on from the text shown: no stream.
    edited = chat_prompt(tok, [*CHAT, {"role": "assistant", "content": " red fox"}])
    assert bridge(tok, stream, len(prompt), text, edited) is None
    assert (
        bridge(tok, stream, len(prompt), text, chat_prompt(tok, [CHAT[0] | {"content": "a"}]))
        is None
    )
