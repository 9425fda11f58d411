"""The episode contract: what a worker samples and a trainer replays must agree.

A worker turns a task's messages into prompt tokens, samples each turn until
a stop string, and shows the environment the turn's text cut at that stop. A
trainer trusts none of a batch's text: it rebuilds the prompt and the turn
texts from token ids alone and rescores them. Both sides call the functions
here, so the two readings of an episode cannot drift apart:

- `SamplingParams`: the rules a worker samples with; run.json's `sampling`
  object carries them from the trainer (`run_sampling`) to every
  worker (docs/protocol.md).
- `chat_prompt`: the prompt tokens of a task's messages; `task_prompt`: of
  a task, with its environment's tools and thinking switch.
- `chat_reply`: a chat-format environment's text after a model turn (its
  tool messages, rendered by the model's template: `toolcalls.py`).
- `episode_stops`: the stop strings, the run's then the environment's.
- `StopMatcher`: where a turn ends (the engine, as tokens arrive) and where
  its text is cut (the engine and `model_turns`).
- `model_turns`: the model's turns, read back from token ids.

Callers: rollout's engine and `run_episodes` (worker side); train's
`rebuild_group`, `Trainer.open` and the warm start's examples (trainer side).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from colonnade.envs import Environment, Task
from colonnade.envs.toolcalls import between_turns, family_of, parse_calls, render, tool_messages


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    max_turn_tokens: int = 96  # model tokens per turn
    max_episode_tokens: int = 512  # model + environment tokens after the prompt
    stop: tuple[str, ...] = ()  # end a turn when the turn's text contains one
    ignore_eos: bool = False  # keep going past EOS (benchmarks with fixed lengths)

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError("temperature must be >= 0")
        if self.top_k < 0 or not 0 < self.top_p <= 1:
            raise ValueError("top_k must be >= 0 and top_p in (0, 1]")
        if self.max_turn_tokens < 1 or self.max_episode_tokens < 1:
            raise ValueError("token limits must be >= 1")


class SamplingSettings(Protocol):
    """What `run_sampling` reads of the trainer's settings (`TrainerConfig`
    has them): named here, so that the wire layer imports no role's config."""

    temperature: float
    max_turn_tokens: int
    max_episode_tokens: int


def run_sampling(cfg: SamplingSettings) -> SamplingParams:
    """How a run's workers sample, from the trainer's settings (into run.json)."""
    return SamplingParams(
        temperature=cfg.temperature,
        max_turn_tokens=cfg.max_turn_tokens,
        max_episode_tokens=cfg.max_episode_tokens,
    )


def chat_prompt(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of the chat messages with the assistant turn opened."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def chat_format(env) -> bool:
    """Whether `env` declares tools: its calls are read in the model's own format."""
    return bool(getattr(env, "tools", None))


def task_prompt(tokenizer, env: Environment, task: Task) -> list[int]:
    """Token ids of a task's prompt: `chat_prompt` of its messages, with the
    environment's `tools` and `thinking` (both optional attributes)."""
    tools = getattr(env, "tools", None) or None
    text = render(tokenizer, env.prompt(task), tools, getattr(env, "thinking", None))
    return tokenizer.encode(text, add_special_tokens=False)


def chat_reply(tokenizer, env: Environment, task: Task, turns: Sequence[str]) -> str | None:
    """What a chat-format environment appends after the newest of `turns`:
    the template's tool messages answering its calls (`env.call` each), or
    None (episode over) when it calls nothing or the turns are used up."""
    if len(turns) >= env.max_turns:
        return None
    calls = parse_calls(turns[-1], family_of(tokenizer))
    if not calls:
        return None
    replies = tool_messages(calls, [env.call(task, c) for c in calls])
    thinking = getattr(env, "thinking", None)
    return between_turns(tokenizer, env.prompt(task), replies, env.tools, thinking)


def episode_stops(stop: Sequence[str], env: Environment) -> tuple[str, ...]:
    """The sampling stop strings joined with the environment's, in order, once each.

    Workers sample with these and the trainer cuts turns with them: both must agree.
    """
    return tuple(dict.fromkeys((*stop, *env.stop)))


class StopMatcher:
    """Finds the first stop string in a turn's text as tokens arrive.

    Stop strings may be split across tokens (`</se` + `arch>`). Only the tail
    of the turn is decoded each step: a byte-level token decodes to at least
    one character, so the last `longest + 2` tokens cover any stop string
    that the newest token can have completed.
    """

    def __init__(self, tokenizer, stops: Sequence[str]):
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.window = max((len(s) for s in self.stops), default=0) + 2

    def hit(self, turn_tokens: Sequence[int]) -> bool:
        if not self.stops:
            return False
        tail = self.tokenizer.decode(turn_tokens[-self.window :], skip_special_tokens=False)
        return any(s in tail for s in self.stops)

    def cut(self, text: str) -> str:
        """`text` up to and including its first stop string (all of it if none)."""
        ends = [text.find(s) + len(s) for s in self.stops if s in text]
        return text[: min(ends)] if ends else text


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
