"""`smoke`: a one-turn task a tiny model learns in a minute, for end-to-end tests.

The prompt names a colour; the reward is 1 when the reply is exactly
`<answer>colour</answer>`. The words are few and all appear in the prompt,
so a copy rule solves it: learning shows within a few dozen steps.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from .answers import exact_match, last_tag
from .base import Metric, Score, Task, check_split

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
UNSURE = "unsure"
SYSTEM = "Reply with the requested word inside <answer></answer>."


class Smoke:
    name = "smoke"
    stop = ("</answer>",)
    max_turns = 1
    success_metric = "correct"  # pass@1 counts episodes whose `correct` is 1
    metrics = (Metric("format_ok", "format ok"),)

    def __init__(self, n_tasks: int, seed: int):
        if n_tasks < 2:
            raise ValueError("n_tasks must be at least 2")
        rng = random.Random(seed)
        tasks = []
        for i in range(n_tasks):
            w = rng.choice(COLOURS)
            tasks.append(Task(f"s{i}", f"The word is {w}. Say the word.", (w,)))
        cut = n_tasks * 4 // 5
        self._split = {"train": tasks[:cut], "test": tasks[cut:]}
        self._by_id = {t.id: t for t in tasks}

    def tasks(self, split: str) -> Sequence[Task]:
        return self._split[check_split(split)]

    def task(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task.question}]

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        return None

    def score(self, task: Task, turns: Sequence[str]) -> Score:
        answer = last_tag(turns[-1], "answer") if turns else None
        correct = answer is not None and exact_match(answer, task.answers)
        metrics = {
            "correct": float(correct),
            "format_ok": float(answer is not None),
            "turns": float(len(turns)),
        }
        return Score(float(correct), metrics)

    def demonstration(self, task: Task, good: bool, rng: random.Random) -> list[str]:
        # The poor demo declines rather than naming a wrong colour: wrong
        # colours on the same prompts contradict the copy rule, and a 2M model
        # then learns only the colours' marginal (pass@1 stays at chance even
        # with mostly good demos: docs/benchmarks.md), leaving RL nothing to
        # amplify.
        # The leading space makes the answer the very token of the prompt's
        # word (" red"), so the skill is a plain copy.
        return [f"<answer> {task.answers[0] if good else UNSURE}</answer>"]

    def tokenizer_texts(self) -> list[str]:
        # Weighted as they occur in episodes (the system prompt opens every
        # one), so the prompt's words and every reply become whole tokens
        # under the tiny tokenizer's merge floor.
        tasks = list(self._by_id.values())
        lines = [*[SYSTEM] * len(tasks), *(t.question for t in tasks)]
        return lines + [f"<answer> {w}</answer>" for w in (*COLOURS, UNSURE)] * 50


def load_environment(n_tasks: int = 500, seed: int = 0) -> Smoke:
    return Smoke(n_tasks, seed)
