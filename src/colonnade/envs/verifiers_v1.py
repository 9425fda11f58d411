"""A `verifiers.v1` taskset as an environment of the classic shape (`envs/verifiers.py`).

verifiers 0.4.0 runs a task of its v1 stack through a harness program, in a
runtime, behind its interception server (docs/environments.md says why that
cannot run inside a worker). For a taskset whose tasks need neither a
container nor tool servers, colonnade plays the harness itself, as
verifiers' tool-less `null` harness does: the task's system prompt and
prompt as chat messages, one model turn, then the task's own scoring,
`Task.score` over a trace that holds the reply (its `@vf.reward` and
`@vf.metric` functions and plugged judges; those that need a runtime are
skipped, as verifiers skips them without one).

A taskset that sets `local_rubric = True` says its rewards follow from the
task and the reply alone: the trainer then recomputes them (train/trust.py).
"""

from __future__ import annotations

from typing import Any

MAX_TASKS = 100_000  # taken from a taskset that yields forever
TEST_FRACTION = 0.2


def is_taskset(obj: Any) -> bool:
    try:
        from verifiers.v1 import Taskset
    except ImportError:
        return False
    return isinstance(obj, Taskset)


class TasksetEnv:
    """The classic shape over a v1 taskset: rows, a one-turn `rollout`, and
    itself as the rubric (`score_rollout` runs the task's scoring)."""

    max_turns = 1

    def __init__(self, taskset, test_fraction: float = TEST_FRACTION):
        task_type = type(taskset).task_type()
        if task_type.NEEDS_CONTAINER or task_type.toolsets(taskset.config.task):
            raise ValueError(
                f"taskset {type(taskset).__name__}: its tasks need a container or tool "
                "servers, which only verifiers' own harnesses run"
            )
        self.local_rubric = bool(getattr(taskset, "local_rubric", False))
        view = taskset if taskset.bounded else taskset.take(MAX_TASKS)
        self._tasks: dict[str, Any] = {}
        rows = []
        for task in view:
            key = f"v1-{task.key[:16]}"
            if key in self._tasks:
                continue
            self._tasks[key] = task
            answer = getattr(task.data, "answer", "")
            rows.append({"id": key, "prompt": _messages(task.data), "info": {"key": key},
                         "answer": "" if answer is None else str(answer)})  # fmt: skip
        cut = len(rows) - max(1, round(len(rows) * test_fraction))
        self.dataset, self.eval_dataset = rows[:cut], rows[cut:]
        self.rubric = self

    async def rollout(self, client, model, prompt, answer="", task="default", info=None,
                      sampling_args=None):  # fmt: skip
        response = await client.chat.completions.create(
            model=model, messages=prompt, **(sampling_args or {})
        )
        reply = {"role": "assistant", "content": response.choices[0].message.content or ""}
        return [reply], {}

    async def score_rollout(self, prompt, completion, answer, state, task="default", info=None):
        """The task's own scoring over a trace holding the last reply."""
        from verifiers.v1 import AgentConfig
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        t = self._tasks[(info or {})["key"]]
        reply = completion[-1]["content"] if completion else ""
        trace = Trace(task=TraceTask(type=type(t).__name__, data=t.data, key=t.key, hash=t.hash),
                      agent=AgentInfo(config=AgentConfig()), root_reply=reply)  # fmt: skip
        await t.score(trace)
        metrics = {k: float(v) for k, v in trace.metrics.items() if v is not None}
        metrics |= {k: float(r.score) for k, r in trace.rewards.items() if r is not None}
        return {"reward": float(trace.reward), "metrics": metrics}


def _messages(data) -> list[dict[str, str]]:
    from verifiers.v1.types import content_text

    head = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if data.prompt is None:
        raise ValueError("a task without a prompt (the user opens it) needs verifiers' harness")
    if isinstance(data.prompt, str):
        return [*head, {"role": "user", "content": data.prompt}]
    return [*head, *({"role": m.role, "content": content_text(m.content)} for m in data.prompt)]
