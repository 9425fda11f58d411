"""Running an environment's tasks through the engine.

`run_episodes` joins the two halves: the environment's prompts and replies,
the engine's tokens. The prompt, the stop strings and the turn texts follow
the episode contract in `protocol/turns.py`, which the trainer replays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from colonnade.engine import Engine, Episode
from colonnade.envs import Environment, Score, Task
from colonnade.protocol.turns import SamplingParams, chat_prompt, episode_stops


@dataclass
class Result:
    task: Task
    episode: Episode
    score: Score


def _responder(env: Environment, task: Task):
    turns: list[str] = []

    def respond(text: str) -> str | None:
        turns.append(text)
        return env.respond(task, list(turns))

    return respond


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
) -> list[Result]:
    """One episode per task (repeat a task in `tasks` for a group), scored.

    `max_rows`, `share_prefix`, `split_replies` and `keys` (one draw key per
    episode) as in `Engine.generate`: a group's copies of a task must be
    consecutive in `tasks` to share their prefill.
    """
    params = replace(params, stop=episode_stops(params.stop, env))
    prompts = [chat_prompt(engine.tokenizer, env.prompt(t)) for t in tasks]
    responders = [_responder(env, t) for t in tasks]
    episodes = engine.generate(
        prompts, responders, params, seed, max_rows, share_prefix, split_replies, keys
    )
    return [Result(t, ep, env.score(t, ep.turns)) for t, ep in zip(tasks, episodes, strict=True)]
