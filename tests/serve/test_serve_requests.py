"""Request bodies are untrusted: each field checked, every refusal a RequestError naming it."""

from __future__ import annotations

import pytest

from colonnade.engine import SamplingParams
from colonnade.engine.loop import seeded_keys
from colonnade.protocol.turns import chat_prompt
from colonnade.serve.requests import Bounds, RequestError, Served, chat_job, completion_job

SERVED = Served("tiny", SamplingParams(temperature=0.7, top_p=0.9), Bounds(context=300))
CHAT = [{"role": "user", "content": "gene GX3"}]


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny[1]


def test_a_chat_request_becomes_its_prompt_limits_and_keys(tok):
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 20, "n": 3, "seed": 5,
            "stop": "</search>", "logprobs": True, "temperature": 0.7, "ignore_eos": True,
            "return_token_ids": True, "user": None}  # fmt: skip
    job = chat_job(body, tok, SERVED)
    assert job.prompts == [chat_prompt(tok, CHAT)] and job.n == 3 and job.chat
    assert job.limits.max_episode_tokens == 20 and job.limits.stop == ("</search>",)
    assert job.limits.ignore_eos and job.logprobs and job.token_ids
    # The server's distribution, whatever the request repeats of it.
    assert (job.limits.temperature, job.limits.top_p) == (0.7, 0.9)
    assert job.keys() == seeded_keys(5, 3)
    fresh = chat_job({"messages": CHAT}, tok, SERVED)
    assert fresh.keys() != fresh.keys()  # no seed: random draws
    # No max_tokens: as many as the bounds and the model's positions leave.
    assert fresh.limits.max_episode_tokens == min(1024, 300 - len(fresh.prompts[0]))


def test_completion_prompts_as_text_ids_or_lists(tok):
    ids = tok.encode("the quick brown")
    one = completion_job({"prompt": "the quick brown"}, tok, SERVED)
    assert one.prompts == [ids] and one.limits.max_episode_tokens == 16  # OpenAI's default
    assert completion_job({"prompt": ids}, tok, SERVED).prompts == [ids]
    many = completion_job({"prompt": ["the quick brown", ids], "n": 2, "logprobs": 0}, tok, SERVED)
    assert many.prompts == [ids, ids] and many.episodes == 4 and many.logprobs


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": CHAT, "temperature": 1.0}, "temperature", "server's"),
        ({"messages": CHAT, "top_p": 1.0}, "top_p", "server's"),
        ({"messages": CHAT, "top_k": 5}, "top_k", "server's"),
        ({"messages": CHAT, "frobnicate": 1}, "frobnicate", "unsupported"),
        ({"messages": CHAT, "stream": True}, "stream", "not supported"),
        ({"messages": CHAT, "presence_penalty": 0.5}, "presence_penalty", "not supported"),
        ({"messages": CHAT, "max_tokens": 1025}, "max_tokens", "1 to 1024"),
        ({"messages": CHAT, "max_tokens": 0}, "max_tokens", "1 to 1024"),
        ({"messages": CHAT, "max_tokens": True}, "max_tokens", "1 to 1024"),
        ({"messages": CHAT, "max_tokens": 290}, "max_tokens", "positions"),
        ({"messages": CHAT, "n": 17}, "n", "1 to 16"),
        ({"messages": CHAT, "seed": 2**64}, "seed", "64-bit"),
        ({"messages": CHAT, "stop": ["a"] * 9}, "stop", "at most 8"),
        ({"messages": CHAT, "stop": [""]}, "stop", "non-empty"),
        ({"messages": CHAT, "top_logprobs": 2}, "top_logprobs", "alternatives"),
        ({"messages": CHAT, "logprobs": 1}, "logprobs", "true or false"),
        ({"messages": []}, "messages", "list of 1"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role", "one of"),
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "string"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0]", "role"),
        ({"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 5}, "max_tokens", "both"),
    ],
)
def test_chat_requests_the_server_refuses_name_the_field(tok, body, param, words):
    with pytest.raises(RequestError, match=words) as e:
        chat_job(body, tok, SERVED)
    assert e.value.param == param and e.value.status == 400


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], [10**9]]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": "x", "logprobs": 3}, "logprobs"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": ["x"] * 9, "n": 8}, None),
        ({"prompt": [5] * 301}, "prompt"),
    ],
)
def test_completion_requests_the_server_refuses(tok, body, param):
    served = Served("tiny", SamplingParams(), Bounds(max_prompt_tokens=300))
    with pytest.raises(RequestError) as e:
        completion_job(body, tok, served)
    assert e.value.param == param and e.value.status == 400


def test_another_model_is_not_found_and_the_body_must_be_an_object(tok):
    with pytest.raises(RequestError) as e:
        chat_job({"model": "gpt-4", "messages": CHAT}, tok, SERVED)
    assert e.value.status == 404 and e.value.code == "model_not_found"
    with pytest.raises(RequestError, match="JSON object"):
        chat_job([CHAT], tok, SERVED)


def test_a_model_without_a_chat_template_is_told_to_use_completions(tok):
    bare = type("Bare", (), {"chat_template": None})()
    with pytest.raises(RequestError, match="no chat template"):
        chat_job({"messages": CHAT}, bare, SERVED)


def test_a_template_that_refuses_the_messages_is_a_400(tok, monkeypatch):
    def strict(*a, **k):
        raise ValueError("roles must alternate")

    monkeypatch.setattr(tok, "apply_chat_template", strict)
    with pytest.raises(RequestError, match="roles must alternate") as e:
        chat_job({"messages": CHAT}, tok, SERVED)
    assert e.value.param == "messages"
