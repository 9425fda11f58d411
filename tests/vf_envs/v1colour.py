"""`colour` as a taskset of verifiers' v1 stack (the real library): tasks of
typed data, the reward a `@vf.reward` method of the task."""

from __future__ import annotations

import random
import re

import verifiers.v1 as vf

from .colour import COLOURS, SYSTEM


class ColourData(vf.TaskData):
    answer: str = ""


class ColourTask(vf.Task[ColourData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def correct(self, task, trace) -> float:
        said = re.findall(r"<answer>(.*?)</answer>", trace.last_reply, flags=re.S)
        return float(bool(said) and said[-1].strip() == task.answer)


class Colours(vf.Taskset[ColourTask, vf.TasksetConfig]):
    local_rubric = True  # the reward follows from the task and the reply alone

    def __init__(self, config, size: int, seed: int):
        super().__init__(config)
        self.size, self.seed = size, seed

    def load(self):
        rng = random.Random(self.seed)
        for _ in range(self.size):
            word = rng.choice(COLOURS)
            yield ColourTask(ColourData(prompt=f"The word is {word}. Say the word.",
                                        system_prompt=SYSTEM, answer=word))  # fmt: skip


def load_environment(size: int = 50, seed: int = 0) -> Colours:
    return Colours(vf.TasksetConfig(id="v1colour"), size, seed)
