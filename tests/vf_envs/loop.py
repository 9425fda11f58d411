"""The multi-turn loop and rubric of verifiers' classic environments, in small.

`rollout` asks the model for a turn through `client.chat.completions`,
passing `sampling_args` into every call (the worker's `extra_body` rides
there), then lets the environment answer (`env_response`) until it says
the episode is over or `max_turns` model turns were taken.
"""

from __future__ import annotations

import re
from collections.abc import Callable


def last_tag(text: str, tag: str) -> str | None:
    found = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.S)
    return found[-1].strip() if found else None


class Rubric:
    """Named reward functions (prompt, completion, answer) -> float, weighted;
    every one is also reported as a metric."""

    def __init__(self, funcs: list[Callable], weights: list[float] | None = None):
        self.funcs = funcs
        self.weights = weights or [1.0] * len(funcs)

    async def score_rollout(self, prompt, completion, answer, state, task="default", info=None):
        metrics = {f.__name__: float(f(prompt, completion, answer)) for f in self.funcs}
        reward = sum(w * metrics[f.__name__] for f, w in zip(self.funcs, self.weights, strict=True))
        return {"reward": reward, "metrics": metrics}


class MultiTurnEnv:
    def __init__(self, dataset, eval_dataset, rubric: Rubric, system_prompt: str = "",
                 max_turns: int = 1):  # fmt: skip
        self.dataset, self.eval_dataset, self.rubric = dataset, eval_dataset, rubric
        self.system_prompt, self.max_turns = system_prompt, max_turns

    def env_response(self, messages: list[dict], state: dict) -> dict | None:
        return None

    async def rollout(self, client, model, prompt, answer="", task="default", info=None,
                      sampling_args=None):  # fmt: skip
        messages, completion, state = list(prompt), [], {"answer": answer, "turns": 0}
        for _ in range(self.max_turns):
            response = await client.chat.completions.create(
                model=model, messages=messages, **(sampling_args or {})
            )
            reply = {"role": "assistant", "content": response.choices[0].message.content or ""}
            messages.append(reply)
            completion.append(reply)
            state["turns"] += 1
            said = self.env_response(messages, state)
            if said is None:
                break
            messages.append(said)
            completion.append(said)
        return completion, state
