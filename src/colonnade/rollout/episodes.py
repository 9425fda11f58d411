"""Running an environment's tasks through the engine, and reading episodes back.

`run_episodes` joins the two halves: the environment's prompts and replies,
the engine's tokens. `model_turns` rebuilds the turn texts from token ids
alone, which is what a trainer scores (it never trusts a worker's text).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from colonnade.envs import Environment, Score, Task

from .engine import Engine, Episode
from .sampling import SamplingParams
from .stops import StopMatcher


@dataclass
class Result:
    task: Task
    episode: Episode
    score: Score


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat messages with the assistant turn opened."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def _responder(env: Environment, task: Task):
    turns: list[str] = []

    def respond(text: str) -> str | None:
        turns.append(text)
        return env.respond(task, list(turns))

    return respond


def episode_stops(stop: Sequence[str], env: Environment) -> tuple[str, ...]:
    """The sampling stop strings joined with the environment's, in order, once each.

    Workers sample with these and the trainer cuts turns with them: both must agree.
    """
    return tuple(dict.fromkeys((*stop, *env.stop)))


def run_episodes(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Task],
    params: SamplingParams,
    seed: int = 0,
    max_rows: int = 0,
    share_prefix: bool = True,
) -> list[Result]:
    """One episode per task (repeat a task in `tasks` for a group), scored.

    `max_rows` and `share_prefix` as in `Engine.generate`: a group's copies
    of a task must be consecutive in `tasks` to share their prefill.
    """
    params = replace(params, stop=episode_stops(params.stop, env))
    prompts = [chat_prompt(engine.tokenizer, env.prompt(t)) for t in tasks]
    responders = [_responder(env, t) for t in tasks]
    episodes = engine.generate(prompts, responders, params, seed, max_rows, share_prefix)
    return [Result(t, ep, env.score(t, ep.turns)) for t, ep in zip(tasks, episodes, strict=True)]


def model_turns(tokenizer, tokens: Sequence[int], from_model: Sequence[bool], stop) -> list[str]:
    """The model's turns as the engine showed them to the environment."""
    turns, current = [], []
    for tok, mine in zip(tokens, from_model, strict=True):
        if mine:
            current.append(tok)
        elif current:
            turns.append(current)
            current = []
    if current:
        turns.append(current)
    cut = StopMatcher(tokenizer, stop).cut
    return [cut(tokenizer.decode(t, skip_special_tokens=True)) for t in turns]
