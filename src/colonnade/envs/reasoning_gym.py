"""`rg:<dataset>`: any dataset of reasoning-gym as a one-turn environment.

    colonnade eval --model tiny --env rg:basic_arithmetic --env-arg size=200
    load_environment("rg:chain_sum", size=500, seed=3, min_terms=2)

The prompt is the dataset's question under a system prompt that asks for
the final answer alone inside <answer></answer>; the reward is the
dataset's own `score_answer` on the last <answer> tag's content (0 without
one). Some datasets give partial credit, so the environment declares
success as reward >= 1 (full credit): that is what pass@1 counts.

Split: one dataset of `size` items at `seed` is generated. reasoning-gym
draws item i from its own generator, Random(seed + i), so no two items share
a seed. Questions are then deduplicated by their text (the first kept), and
the unique ones are cut in order: `shots` few-shot examples, then train,
then the last `test_fraction` for test. No question text is in two parts.

Arguments: `size` and `seed` and every other key of the dataset's config
(e.g. `min_terms`, `operators`) go to reasoning-gym; `test_fraction` and
`shots` are the adapter's. Everything is held in memory from construction,
and `score` calls only `score_answer` on what it is given, so the trainer,
which rebuilds this environment from run.json and replays `score`, gets the
worker's reward. A task id carries a hash of its question, so a worker
whose reasoning-gym generated another question under the same index sends
an id the trainer does not know (it rejects the group) instead of one it
would score against another answer.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import math
from collections.abc import Sequence
from typing import Any

from .answers import last_tag
from .base import Metric, Score, Task, check_split

SYSTEM = (
    "Answer the question. Give the final answer alone inside <answer></answer>, "
    "with no explanation inside the tags."
)
INSTALL = "pip install 'colonnade[tasks]'"


class ReasoningGym:
    stop = ("</answer>",)
    max_turns = 1
    success_threshold = 1.0  # full credit from score_answer: what pass@1 counts
    metrics = (Metric("format_ok", "format ok"),)

    def __init__(self, dataset: str, data, test_fraction: float, shots: int):
        self.name = f"rg:{dataset}"
        self._score_answer = data.score_answer
        self._entries: dict[str, dict[str, Any]] = {}
        tasks = _unique_tasks(dataset, data, self._entries)
        self.shots, rest = tasks[:shots], tasks[shots:]
        cut = len(rest) - math.ceil(len(rest) * test_fraction)
        if cut < 1 or cut == len(rest):
            raise ValueError(
                f"{self.name}: {len(tasks)} distinct questions of {len(data)} leave {max(cut, 0)} "
                f"for train and {len(rest) - max(cut, 0)} for test after {shots} shots; "
                "raise size or change test_fraction"
            )
        self._split = {"train": rest[:cut], "test": rest[cut:]}
        self._by_id = {t.id: t for t in rest}

    def tasks(self, split: str) -> Sequence[Task]:
        return self._split[check_split(split)]

    def task(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        """The system prompt, each few-shot example as a user turn and the
        assistant's tagged answer, then the question."""
        messages = [{"role": "system", "content": SYSTEM}]
        for shot in self.shots:
            messages += [
                {"role": "user", "content": shot.question},
                {"role": "assistant", "content": f"<answer>{shot.answers[0]}</answer>"},
            ]
        return [*messages, {"role": "user", "content": task.question}]

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        return None

    def score(self, task: Task, turns: Sequence[str]) -> Score:
        answer = last_tag(turns[-1], "answer") if turns else None
        reward = 0.0 if answer is None else self._reward(answer, self._entries[task.id])
        metrics = {"format_ok": float(answer is not None), "turns": float(len(turns))}
        return Score(reward, metrics)

    def _reward(self, answer: str, entry: dict[str, Any]) -> float:
        # Model output is arbitrary text: a scorer that chokes on it scores 0.
        try:
            reward = float(self._score_answer(answer, entry))
        except Exception:
            return 0.0
        return min(1.0, max(0.0, reward)) if math.isfinite(reward) else 0.0

    def tokenizer_texts(self) -> list[str]:
        # The system prompt opens every episode: weighted so, as smoke's is.
        tasks = [*self.shots, *self._by_id.values()]
        answers = [f"<answer>{t.answers[0]}</answer>" for t in tasks]
        return [*[SYSTEM] * len(tasks), *(t.question for t in tasks), *answers]


def _unique_tasks(dataset: str, data, entries: dict[str, dict[str, Any]]) -> list[Task]:
    """One Task per distinct question, in the dataset's order; fills `entries` by task id."""
    tasks, seen = [], set()
    for i in range(len(data)):
        entry = data[i]
        question = str(entry["question"])
        if question in seen:
            continue
        seen.add(question)
        task_id = f"rg{i}-{hashlib.sha256(question.encode()).hexdigest()[:8]}"
        answer = "" if entry.get("answer") is None else str(entry["answer"])
        tasks.append(Task(task_id, question, (answer,), {"dataset": dataset, "index": str(i)}))
        entries[task_id] = entry
    return tasks


def _dataset(name: str, config: dict[str, Any]):
    try:
        import reasoning_gym
        from reasoning_gym.factory import DATASETS
    except ImportError as e:
        raise ValueError(f"environment rg:{name} needs reasoning-gym ({e}): {INSTALL}") from None
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise ValueError(f"reasoning-gym has no dataset {name!r}{hint}")
    fields = [f.name for f in dataclasses.fields(DATASETS[name][1])]
    unknown = sorted(set(config) - set(fields))
    if unknown:
        raise ValueError(
            f"rg:{name} has no setting {', '.join(unknown)}; its settings: "
            f"{', '.join(fields)}, test_fraction, shots"
        )
    try:
        return reasoning_gym.create_dataset(name, **config)
    except (AssertionError, ValueError, TypeError) as e:  # the config's validate()
        raise ValueError(f"rg:{name}: bad settings {config}: {e or type(e).__name__}") from None


def load_environment(
    dataset: str,
    size: int = 1000,
    seed: int = 0,
    test_fraction: float = 0.2,
    shots: int = 0,
    **config: Any,
) -> ReasoningGym:
    """`size` questions of reasoning-gym's `dataset` at `seed`, before deduplication."""
    if size < 2 or not 0.0 < test_fraction < 1.0 or shots < 0:
        raise ValueError("size must be >= 2, test_fraction within (0, 1), shots >= 0")
    data = _dataset(dataset, {**config, "size": size, "seed": seed})
    return ReasoningGym(dataset, data, test_fraction, shots)
