"""Running an environment's tasks through the engine.

`run_episodes` joins the two halves: the environment's prompts and replies,
the engine's tokens. The prompt, the stop strings and the turn texts follow
the episode contract in `protocol/turns.py`, which the trainer replays. An
environment with a tool service has its served turns answered by the
service, each reply signed for the episode's row and turn (tools/served.py).
A chat-format environment (one that declares `tools`) has its calls read in
the model's own format and answered by tool messages that the model's
template renders (`protocol.turns.chat_reply`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from colonnade.engine import Engine, Episode
from colonnade.engine.loop import seeded_keys
from colonnade.envs import Environment, Score, Task
from colonnade.protocol.turns import (
    SamplingParams,
    chat_format,
    chat_reply,
    episode_stops,
    task_prompt,
)
from colonnade.tools.client import Retry
from colonnade.tools.served import EpisodeTools, client_for, served
from colonnade.tools.signed import Reply

MAX_CALLS_OUT = 64  # a worker's tool calls in flight at once


@dataclass
class Result:
    task: Task
    episode: Episode
    score: Score
    tools: list[Reply] = field(default_factory=list)  # the signed replies it shows
    tool_failed: str = ""  # why its tool service gave no reply ("": none failed)


def _responder(env: Environment, task: Task, tools: EpisodeTools | None = None, tokenizer=None):
    turns: list[str] = []
    chat = chat_format(env)

    def respond(text: str) -> str | Future[str | None] | None:
        turns.append(text)
        if tools is not None:
            return tools.respond(list(turns))
        if chat:
            return chat_reply(tokenizer, env, task, list(turns))
        return env.respond(task, list(turns))

    return respond


def _served_turns(ep: Episode) -> int:
    """How many replies the episode shows (a reply cut by the token budget is not shown)."""
    model = ep.from_model
    return sum(1 for i in range(1, len(model)) if model[i - 1] and not model[i])


def _result(env, task: Task, ep: Episode, tools: EpisodeTools | None) -> Result:
    if tools is None:
        return Result(task, ep, env.score(task, ep.turns))
    if tools.failed:
        ep.finish = "tool"  # the trainer counts the group out, never trains it
    shown = [r for r in tools.replies if r.call.turn <= _served_turns(ep)]
    score = env.score(task, ep.turns, results=[r.result for r in shown])
    return Result(task, ep, score, shown, tools.failed)


def tool_figures(results: Sequence[Result]) -> dict[str, float]:
    """A batch's tool figures for its stats (informational): episodes whose
    service gave no reply, and the signed replies shown."""
    if not any(r.tools or r.tool_failed for r in results):
        return {}
    return {
        "tool_failures": float(sum(bool(r.tool_failed) for r in results)),
        "tool_replies": float(sum(len(r.tools) for r in results)),
    }


def run_episodes(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Task],
    params: SamplingParams,
    seed: int = 0,
    max_rows: int = 0,
    share_prefix: bool = True,
    split_replies: bool = True,
    keys: Sequence[bytes] | None = None,
    run_id: str = "",
    retry: Retry | None = None,
    async_tools: bool = True,
) -> list[Result]:
    """One episode per task (repeat a task in `tasks` for a group), scored.

    `max_rows`, `share_prefix`, `split_replies` and `keys` (one draw key per
    episode) as in `Engine.generate`: a group's copies of a task must be
    consecutive in `tasks` to share their prefill. A served environment's
    calls name `run_id` and each episode's draw key (its row); `retry`:
    how long a call may take (tools/client.py). With `async_tools`, a row
    whose call is out waits beside the batch while the other rows decode
    (engine/loop.py); without, the whole batch waits for each call. An
    environment that runs
    its own loop over an OpenAI API (`vf:NAME`) runs it against an endpoint
    over `engine` (`endpoint.py`).
    """
    if getattr(env, "worker_rewards", False):
        from .endpoint import run_through_endpoint

        return run_through_endpoint(env, engine, tasks, params, seed, max_rows, keys)
    params = replace(params, stop=episode_stops(params.stop, env))
    prompts = [task_prompt(engine.tokenizer, env, t) for t in tasks]
    if keys is None:
        keys = seeded_keys(seed, len(tasks))
    tools: list[EpisodeTools | None] = [None] * len(tasks)
    with contextlib.ExitStack() as stack:
        if served(env):
            client = client_for(env, retry)
            pool = None
            if async_tools:
                threads = min(len(tasks), MAX_CALLS_OUT)
                pool = stack.enter_context(ThreadPoolExecutor(threads, "tool-call"))
            tools = [
                EpisodeTools(env, t, client, run_id, k.hex(), pool)
                for t, k in zip(tasks, keys, strict=True)
            ]
        responders = [
            _responder(env, t, x, engine.tokenizer) for t, x in zip(tasks, tools, strict=True)
        ]
        episodes = engine.generate(
            prompts, responders, params, seed, max_rows, share_prefix, split_replies, keys
        )
    return [_result(env, t, ep, x) for t, ep, x in zip(tasks, episodes, tools, strict=True)]
