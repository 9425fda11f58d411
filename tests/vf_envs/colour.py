"""One turn, a local rubric: say the colour named in the prompt, inside <answer>."""

from __future__ import annotations

import random

from .loop import MultiTurnEnv, Rubric, last_tag

COLOURS = ("red", "blue", "green", "yellow", "purple", "orange", "black", "white")
SYSTEM = "Reply with the requested word inside <answer></answer>."
UNSURE = "unsure"


def correct(prompt, completion, answer) -> float:
    said = last_tag(completion[-1]["content"], "answer") if completion else None
    return float(said == answer)


def format_ok(prompt, completion, answer) -> float:
    return float(bool(completion) and last_tag(completion[-1]["content"], "answer") is not None)


def load_environment(size: int = 200, seed: int = 0) -> MultiTurnEnv:
    rng = random.Random(seed)
    rows = []
    for i in range(size):
        word = rng.choice(COLOURS)
        rows.append({"question": f"The word is {word}. Say the word.", "answer": word,
                     "id": f"c{i}"})  # fmt: skip
    cut = size * 4 // 5
    env = MultiTurnEnv(rows[:cut], rows[cut:], Rubric([correct, format_ok], [1.0, 0.0]), SYSTEM)
    env.local_rubric = True  # the reward follows from prompt and completion alone
    env.success_metric = "correct"
    env.demonstration = demonstration
    env.tokenizer_texts = lambda: tokenizer_texts(rows)
    return env


def demonstration(task, good: bool, rng) -> list[str]:
    """A warm start's turn, as smoke's: the word, or a refusal (a wrong
    colour would contradict the copy rule a small model is to learn)."""
    return [f"<answer> {task.answers[0] if good else UNSURE}</answer>"]


def tokenizer_texts(rows) -> list[str]:
    # As the episodes weigh them (the system prompt opens every one), so
    # every reply is a few whole tokens under the tiny tokenizer.
    lines = [*[SYSTEM] * len(rows), *(r["question"] for r in rows)]
    return lines + [f"<answer> {w}</answer>" for w in (*COLOURS, UNSURE)] * 50
