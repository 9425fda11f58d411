"""The environment interface: tasks, prompts, tool replies and scores.

An environment is a small module exposing `load_environment(**kwargs)` that
returns an object with this shape (the shape users know from verifiers).
Everything is pure and deterministic under the constructor's seed, with no
network: the trainer re-runs `respond` and `score` on what workers send, so
a worker's claimed reward is never used.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

SPLITS = ("train", "test")
SUCCESS_THRESHOLD = 1.0  # what an environment that declares nothing counts as solved
log = logging.getLogger("colonnade.envs")


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
    """What every environment has. Optional attributes, read with getattr:

    `success_metric` (str): the metric of `Score.metrics` that says an
    episode solved its task; `success_threshold` (float, default 1.0): the
    value it must reach. Without `success_metric`, success is
    `reward >= success_threshold`. pass@1 counts successes (`Success`).

    `metrics` (tuple of `Metric` or str): the metrics of `Score.metrics`
    worth showing beside reward and pass@1, each with a human label (a bare
    str is its own label). The live view, the run's log lines, Prometheus
    (`colonnade_env_metric{metric=...}`) and eval show these; read them
    with `metrics_of`. Without it an environment shows none beyond reward
    and pass@1 (eval and the report still list every metric returned).

    `warmstart_defaults` (dict): model preset -> warm-start settings (fields
    of `train.warmstart.WarmstartConfig`) over the model's defaults.

    `tokenizer_texts()` (-> list of str): text a locally trained tokenizer
    learns from; only the `tiny` model preset needs it (read with
    `tokenizer_texts_of`). A pretrained model brings its own tokenizer.
    """

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


@dataclass(frozen=True)
class Metric:
    """A metric an environment declares for display (`Environment.metrics`)."""

    name: str  # its key in `Score.metrics`
    label: str = ""  # for people; "" : the name
    report: str = ""  # its key in eval figures; "": the name

    @property
    def title(self) -> str:
        return self.label or self.name

    @property
    def key(self) -> str:
        return self.report or self.name


def tokenizer_texts_of(env: Any) -> list[str]:
    """The text the tiny preset's tokenizer learns from; a ValueError saying
    what to do when the environment has none."""
    texts = getattr(env, "tokenizer_texts", None)
    if not callable(texts):
        name = getattr(env, "name", type(env).__name__)
        raise ValueError(
            f"environment {name} has no tokenizer_texts(): the tiny model preset trains its "
            "tokenizer on the environment's text; use a pretrained model (--model "
            "smollm2-135m, a model directory or a hub name) or add tokenizer_texts()"
        )
    out = list(texts())
    if not out or not all(isinstance(t, str) for t in out):
        raise ValueError("tokenizer_texts() must return a non-empty list of strings")
    return out


def metrics_of(env: Any) -> tuple[Metric, ...]:
    """The metrics `env` declares for display (none if it declares none)."""
    declared = getattr(env, "metrics", None) or ()
    if isinstance(declared, str):
        declared = (declared,)
    return tuple(m if isinstance(m, Metric) else Metric(str(m)) for m in declared)


@dataclass(frozen=True)
class Success:
    """When an episode counts as solved, for pass@1: a metric (or the reward) >= threshold."""

    metric: str | None  # None: the reward
    threshold: float
    declared: bool  # False: the environment declares neither attribute

    def __call__(self, score: Score) -> bool:
        value = score.reward if self.metric is None else score.metrics.get(self.metric, 0.0)
        return value >= self.threshold

    def describe(self) -> str:
        """The rule as eval and run print it, e.g. `correct >= 1, declared`."""
        how = "declared" if self.declared else "the default: the environment declares none"
        return f"{self.metric or 'reward'} >= {self.threshold:g}, {how}"


_warned: set[str] = set()


def success_of(env: Any) -> Success:
    """The environment's declared success rule; warns once per environment name if none."""
    metric = getattr(env, "success_metric", None)
    threshold = getattr(env, "success_threshold", None)
    declared = metric is not None or threshold is not None
    rule = Success(metric, float(SUCCESS_THRESHOLD if threshold is None else threshold), declared)
    name = str(getattr(env, "name", type(env).__name__))
    if not declared and name not in _warned:
        _warned.add(name)
        log.warning(
            "environment %s declares no success_metric or success_threshold: "
            "pass@1 counts episodes with reward >= %g",
            name,
            rule.threshold,
        )
    return rule


def check_split(split: str) -> str:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    return split
