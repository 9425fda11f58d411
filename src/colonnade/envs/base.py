"""The environment interface: tasks, prompts, tool replies and scores.

An environment is a small module exposing `load_environment(**kwargs)` that
returns an object with this shape (the shape users know from verifiers).
Everything is pure and deterministic under the constructor's seed, with no
network: the trainer re-runs `respond` and `score` on what workers send, so
a worker's claimed reward is never used.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

SPLITS = ("train", "test")


@dataclass(frozen=True)
class Task:
    id: str
    question: str
    answers: tuple[str, ...]  # the answer first, then accepted synonyms
    info: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Score:
    reward: float
    metrics: Mapping[str, float]


@runtime_checkable
class Environment(Protocol):
    name: str
    stop: tuple[str, ...]  # strings that end a model turn
    max_turns: int

    def tasks(self, split: str) -> Sequence[Task]: ...

    def task(self, task_id: str) -> Task:
        """The task with this id, any split; KeyError if none."""
        ...

    def prompt(self, task: Task) -> list[dict[str, str]]:
        """Chat messages (system, user) that open an episode."""
        ...

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        """Text to append after the newest model turn, or None: episode over."""
        ...

    def score(self, task: Task, turns: Sequence[str]) -> Score:
        """Reward and named metrics of a finished episode (its model turns)."""
        ...

    def tokenizer_texts(self) -> list[str]:
        """Text a locally trained tokenizer should learn from."""
        ...


@runtime_checkable
class Demonstrating(Protocol):
    """An environment that can write supervised demonstrations (for warm start)."""

    def demonstration(self, task: Task, good: bool, rng) -> list[str]:
        """Model turns of one demo: a good trajectory, or a plausible poor one.

        The warm start replays the turns through `respond`, so the tool
        replies in a demo are exactly those the environment would give.
        """
        ...


@runtime_checkable
class Practising(Protocol):
    """An environment that can make a disjoint twin of itself for warm-start demos."""

    def practice(self, seed: int) -> Environment:
        """The same task over other data (no entity, answer or document in common)."""
        ...


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return split
