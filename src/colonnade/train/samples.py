"""Turning untrusted rollout batches into training samples the trainer believes.

A worker sends token ids, which of them it wrote, and its log-probs. The
trainer rebuilds the prompt from the task id, decodes the model's turns from
the ids, replays the environment on them and checks that every tool reply
in the episode is exactly what the environment answers, then scores the
turns itself. The worker's own reward or text is never used. A reply of a
tool service is not replayed: its signature is checked (train/replies.py);
a chat-format environment's tool messages are rendered again by the model's
template (`protocol.turns.chat_reply`), which the worker's must match.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

from colonnade.envs import Environment, Score
from colonnade.protocol import EpisodeRecord, GroupRecord
from colonnade.protocol.turns import chat_format, chat_reply, model_turns, task_prompt
from colonnade.tools.served import score as score_episode

from .replies import Answers, ToolRejected
from .trust import rebuild_worker_group


class Rejected(ValueError):
    """An episode or group that does not replay as the environment would run it."""


@dataclass
class Sample:
    task_id: str
    version: int  # of the policy that generated it
    prompt_len: int
    ids: list[int]  # prompt + generated tokens
    from_model: list[bool]  # over the generated tokens
    behaviour_logp: list[float]  # over the generated tokens
    score: Score
    worker: str = ""  # who sent it (set by the collector from the object key)
    reward_from: str = "recomputed"  # or "trusted": the worker's word (train/trust.py)


def _segments(from_model: Sequence[bool]) -> list[tuple[bool, int, int]]:
    """(is_model, start, end) runs of the mask."""
    out, start = [], 0
    for i in range(1, len(from_model) + 1):
        if i == len(from_model) or from_model[i] != from_model[start]:
            out.append((from_model[start], start, i))
            start = i
    return out


def _check_replies(tokenizer, env: Environment, task, ep: EpisodeRecord, turns) -> list:
    """Every reply as the environment gives it (a service's: as signed); the
    service's results, for the score."""
    answers = Answers(env, task, ep)
    respond = answers.respond
    if chat_format(env) and not answers.served:
        respond = partial(chat_reply, tokenizer, env, task)
    segs = _segments(ep.from_model)
    model_segs = [s for s in segs if s[0]]
    env_segs = [s for s in segs if not s[0]]
    if len(model_segs) != len(turns) or len(turns) > env.max_turns:
        raise Rejected("turn structure does not match the tokens")
    for i, (_, start, end) in enumerate(env_segs):
        reply = respond(list(turns[: i + 1]))
        if reply is None:
            raise Rejected(f"tool text after turn {i + 1}, where the environment ends")
        if list(ep.tokens[start:end]) != tokenizer.encode(reply, add_special_tokens=False):
            what = ToolRejected if answers.signed else Rejected  # a signed reply's text changed
            raise what(f"tool reply after turn {i + 1} differs from the environment's")
    if len(env_segs) == len(turns) and ep.finish == "done":
        raise Rejected("episode ends on a tool reply but claims the environment ended it")
    answers.finish(turns, len(env_segs))
    return answers.results


def rebuild_episode(
    tokenizer, env: Environment, task_id: str, ep: EpisodeRecord, version: int, stop, max_len: int
) -> Sample:
    task = env.task(task_id)
    prompt = task_prompt(tokenizer, env, task)
    if len(prompt) + len(ep.tokens) > max_len:
        raise Rejected(f"episode of {len(prompt) + len(ep.tokens)} tokens exceeds {max_len}")
    turns = model_turns(tokenizer, ep.tokens, ep.from_model, stop)
    results = _check_replies(tokenizer, env, task, ep, turns)
    return Sample(
        task_id,
        version,
        len(prompt),
        prompt + list(ep.tokens),
        list(ep.from_model),
        list(ep.logprobs),
        score_episode(env, task, turns, results),
    )


def rebuild_group(
    tokenizer,
    env: Environment,
    group: GroupRecord,
    version: int,
    stop,
    max_len: int,
    train_ids: set[str],
) -> list[Sample]:
    """All episodes of a group, or Rejected: one bad episode spoils its group
    (its advantages would be computed against a partial group)."""
    if getattr(env, "worker_rewards", False):  # episodes of the env's own loop: no replay
        return rebuild_worker_group(tokenizer, env, group, version, stop, max_len, train_ids)
    if group.task_id not in train_ids:
        raise Rejected(f"task {group.task_id!r} is not a training task")
    return [
        rebuild_episode(tokenizer, env, group.task_id, ep, version, stop, max_len)
        for ep in group.episodes
    ]
