"""`vf:NAME`: an environment in verifiers' shape, run by its own loop over an OpenAI API.

    colonnade eval --model tiny --env vf:my_env --env-arg size=200

NAME is an importable module (an installed environment package, `-` read
as `_`, or an import path) whose `load_environment(**kwargs)` returns an
environment of verifiers' classic shape:

- `dataset` (and optionally `eval_dataset`): rows, each a mapping with
  `prompt` (chat messages) or `question` (text, under the environment's
  `system_prompt`), and optionally `answer`, `info`, `task`, `id`;
- `async rollout(client, model, prompt, answer, task, info, sampling_args)`
  -> (completion messages, state): the episode, every model turn one
  chat-completions call on the `openai.AsyncOpenAI` client it is given,
  with `sampling_args` passed into each call;
- `rubric.score_rollout(prompt, completion, answer, state, task, info)` ->
  an object with `reward` (and `metrics`), a mapping of those, or a number
  (a coroutine or not);
- optional: `max_turns`, `local_rubric` (True: the rubric scores from the
  prompt and completion alone, with no network, model or randomness), and
  the colonnade attributes of `envs.base.Environment` (`success_metric`,
  `metrics`, `demonstration` for a warm start, `tokenizer_texts`, ...).

On a worker (`rollout/endpoint.py`) the environment's own loop runs against an
endpoint in the worker's process (`colonnade.serve`, `Served.episodes`)
over the worker's engine: each episode gets its draw key, every request
of the episode names it (`colonnade_episode`, passed through
`sampling_args["extra_body"]`), and the endpoint stitches the turns into
one token stream: the model's tokens with their μ, everything the next
prompt adds (tool results, the template's markup) masked as the
environment's. The rubric's reward, computed on the worker, travels with
the batch; the trainer recomputes it where it can (a local rubric over an
episode of one turn) and otherwise takes it only from workers the operator
trusts (train/trust.py, docs/security.md).

verifiers 0.4.0 itself (its `verifiers.v1` stack) runs an episode through a
harness program that installs its dependencies with `uv` at launch, in a
runtime behind its interception server; that cannot run offline or inside a
worker's engine, so this adapter takes the classic shape above. A
`load_environment` that returns a `verifiers.v1` taskset is taken into that
shape (`verifiers_v1.py`: one turn, the task's own scoring).
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import inspect
import json
import math
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from .base import Score, Task, check_split
from .verifiers_v1 import TasksetEnv, is_taskset

TEST_FRACTION = 0.2  # of `dataset` held out for test when there is no `eval_dataset`
MAX_TURNS = 64  # an environment that names no bound (or -1)
# colonnade's optional attributes (envs/base.py), taken from the environment
# where it has them: `demonstration` is called with colonnade's `Task`.
FORWARDED = ("success_metric", "success_threshold", "metrics", "warmstart_defaults",
             "demonstration", "tokenizer_texts")  # fmt: skip


class Verifiers:
    """A verifiers-shaped environment as colonnade's `Environment`.

    Its episodes come from its own loop (`rollout/endpoint.py`), so `respond` is
    never asked; `worker_rewards` tells the worker to send the rubric's
    rewards and the trainer to take them under its trust rule.
    """

    stop: tuple[str, ...] = ()
    worker_rewards = True

    def __init__(self, name: str, env: Any):
        self.name = f"vf:{name}"
        self.env = env
        turns = int(getattr(env, "max_turns", 1) or 1)
        self.max_turns = turns if turns > 0 else MAX_TURNS
        self.local_rubric = bool(getattr(env, "local_rubric", False))
        for attr in FORWARDED:
            if hasattr(env, attr):
                setattr(self, attr, getattr(env, attr))
        rows = list(getattr(env, "dataset", None) or ())
        held = getattr(env, "eval_dataset", None)
        if held is None:
            cut = len(rows) - math.ceil(len(rows) * TEST_FRACTION)
            rows, held = rows[:cut], rows[cut:]
        self._rows: dict[str, Mapping] = {}
        self._split = {"train": self._tasks(rows, "train"), "test": self._tasks(held, "test")}
        self._by_id = {t.id: t for s in self._split.values() for t in s}
        if not self._split["train"] or not self._split["test"]:
            raise ValueError(f"{self.name}: no tasks for train or test")

    def _tasks(self, rows, split: str) -> list[Task]:
        out = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(f"{self.name}: row {i} of {split} is not a mapping")
            messages = self._messages(row)
            answer = str(row.get("answer", "") or "")
            digest = hashlib.sha256(json.dumps([messages, answer]).encode()).hexdigest()[:8]
            task_id = str(row.get("id") or f"vf-{split}{i}-{digest}")
            if task_id in self._rows:
                continue  # the same row twice: one task
            self._rows[task_id] = {**row, "prompt": messages, "answer": answer}
            question = next((m["content"] for m in reversed(messages) if m["role"] == "user"), "")
            out.append(Task(task_id, question, (answer,), {"task": str(row.get("task", ""))}))
        return out

    def _messages(self, row: Mapping) -> list[dict[str, str]]:
        prompt = row.get("prompt")
        if prompt is None:
            system = getattr(self.env, "system_prompt", None)
            head = [{"role": "system", "content": system}] if system else []
            return [*head, {"role": "user", "content": str(row.get("question", ""))}]
        if isinstance(prompt, str):
            return [{"role": "user", "content": prompt}]
        return [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]

    # -- the Environment interface --------------------------------------------------
    def tasks(self, split: str) -> Sequence[Task]:
        return self._split[check_split(split)]

    def task(self, task_id: str) -> Task:
        return self._by_id[task_id]

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return [dict(m) for m in self._rows[task.id]["prompt"]]

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        return None  # its own loop makes the episodes (rollout/endpoint.py)

    def score(self, task: Task, turns: Sequence[str]) -> Score:
        """The rubric over the model's turns as the completion, with an empty
        state: what the trainer recomputes (a local rubric, one turn)."""
        completion = [{"role": "assistant", "content": t} for t in turns]
        return run_async(self._score(self._rows[task.id], completion, {}))

    def rescorable(self, model_turns: int, environment_segments: int) -> bool:
        """Whether the trainer can recompute an episode's reward: a local rubric
        and no environment text in it (tool results it cannot check)."""
        return self.local_rubric and environment_segments == 0 and model_turns == 1

    def tokenizer_texts(self) -> list[str]:
        rows = list(self._rows.values())
        texts = [m["content"] for r in rows for m in r["prompt"]]
        return texts + [str(r["answer"]) for r in rows if r["answer"]]

    # -- the episodes ---------------------------------------------------------------
    async def _score(self, row: Mapping, completion: list, state: Any) -> Score:
        got = self.env.rubric.score_rollout(
            row["prompt"], completion, row["answer"], state, row.get("task", "default"),
            row.get("info") or {},
        )  # fmt: skip
        if inspect.isawaitable(got):
            got = await got
        return as_score(got)

    async def play(self, client, task: Task, extra_body: dict, max_tokens: int):
        """One episode through `client`: (completion, state, Score)."""
        row = self._rows[task.id]
        sampling = {"max_tokens": max_tokens, "extra_body": extra_body}
        completion, state = await self.env.rollout(
            client, self.name, row["prompt"], row["answer"], row.get("task", "default"),
            row.get("info") or {}, sampling,
        )  # fmt: skip
        return completion, state, await self._score(row, completion, state)


def as_score(got: Any) -> Score:
    """A rubric's answer as a `Score`: an object or mapping with `reward` and
    optional `metrics`, or a number."""
    if isinstance(got, int | float):
        return Score(float(got), {})
    reward = got["reward"] if isinstance(got, Mapping) else got.reward
    metrics = got.get("metrics") if isinstance(got, Mapping) else getattr(got, "metrics", None)
    if not math.isfinite(float(reward)):  # a batch could not carry it
        raise ValueError(f"the rubric's reward {reward!r} is not a finite number")
    return Score(float(reward), {str(k): float(v) for k, v in (metrics or {}).items()})


def run_async(coroutine):
    """Run `coroutine` to its end from synchronous code, whether or not this
    thread already runs an event loop (then on a thread of its own)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    box: list = []
    thread = threading.Thread(target=lambda: box.append(asyncio.run(coroutine)))
    thread.start()
    thread.join()
    return box[0]


def load_environment(name: str, **kwargs) -> Verifiers:
    """`vf:NAME`: NAME's `load_environment(**kwargs)`, adapted."""
    from .registry import _bind

    module_name = name.replace("-", "_")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            raise ValueError(
                f"environment vf:{name}: no module {module_name!r}; install the environment "
                "package (pip install ...) or name an import path"
            ) from None
        raise
    loader = getattr(module, "load_environment", None)
    if not callable(loader):
        raise ValueError(f"module {module_name} has no load_environment(**kwargs)")
    _bind(loader, f"vf:{name}", kwargs)
    env = loader(**kwargs)
    if is_taskset(env):  # verifiers' v1 stack: colonnade plays its harness
        env = TasksetEnv(env)
    missing = [a for a in ("dataset", "rollout", "rubric") if not hasattr(env, a)]
    if missing:
        raise ValueError(f"vf:{name}: load_environment() returned an object lacking {missing}")
    return Verifiers(name, env)
