"""Several turns with a tool: look a code up, then answer it.

The model asks `<lookup>NAME</lookup>`; the environment answers with the
code as a tool message; the model answers `<answer>CODE</answer>`. A turn
with neither gets a reminder, until `max_turns`. The tool is a table here,
but the trainer is not told so: a tool's results are what a worker says
they were.
"""

from __future__ import annotations

import random

from .loop import MultiTurnEnv, Rubric, last_tag

NAMES = ("alpha", "bravo", "delta", "echo", "kilo", "lima", "oscar", "tango")
REMINDER = "Use <lookup>NAME</lookup> or <answer>CODE</answer>."
SYSTEM = "Look the name up with <lookup>NAME</lookup>, then reply <answer>CODE</answer>."


class Lookup(MultiTurnEnv):
    def __init__(self, rows, held, codes: dict[str, str]):
        super().__init__(rows, held, Rubric([answered]), SYSTEM, max_turns=3)
        self.codes = codes

    def env_response(self, messages, state):
        said = messages[-1]["content"]
        if last_tag(said, "answer") is not None:
            return None
        asked = last_tag(said, "lookup")
        if asked is None:
            return {"role": "user", "content": REMINDER}
        return {"role": "tool", "content": self.codes.get(asked, "unknown")}


def answered(prompt, completion, answer) -> float:
    said = last_tag(completion[-1]["content"], "answer") if completion else None
    return float(said == answer)


def load_environment(size: int = 100, seed: int = 0) -> Lookup:
    rng = random.Random(seed)
    codes = {n: str(rng.randrange(100, 1000)) for n in NAMES}
    rows = []
    for i in range(size):
        name = rng.choice(NAMES)
        rows.append({"question": f"What is the code of {name}?", "answer": codes[name],
                     "id": f"l{i}"})  # fmt: skip
    cut = size * 4 // 5
    return Lookup(rows[:cut], rows[cut:], codes)
