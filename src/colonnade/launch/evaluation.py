"""Held-out evaluation inside a run: of a model directory, or of a published version.

"After" evaluates the newest published version through the same path a
worker runs it (int8 codes from the store, verified by hash), so the figure
is that of the policy the fleet runs, not of the trainer's float weights.
The run's final model folder is `operate.export.export_version`'s.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

from colonnade.engine import Engine, SamplingParams, engine_for, load_engine, resolve_engine
from colonnade.envs import Environment
from colonnade.model import pick_device
from colonnade.operate.export import Say, open_view, published, rebuild
from colonnade.protocol import VersionError, keys
from colonnade.protocol.model_files import fetch_model
from colonnade.rollout.evaluate import Progress, evaluate
from colonnade.store import ObjectStore, StoreError

log = logging.getLogger("colonnade.run")


def version_engine(
    store: ObjectStore,
    version: int | None,
    engine: str = "torch",
    device: str = "cpu",
    trusted: str | None = None,
    say: Say | None = None,
) -> Engine:
    """Published `version` (None: the newest) on the engine a worker with
    `--engine engine --device device` runs, rebuilt as that worker rebuilds it
    (`operate.export.rebuild`): the architecture checked before any weights."""
    view = open_view(store, trusted)
    v = published(store, view, version)
    model, tok = fetch_model(store, view.spec)
    kind = resolve_engine(engine, model.config.model_type)
    state = rebuild(store, view, v, say)
    return engine_for(model, tok, state, view.spec.precision, pick_device(device), kind, v)


def run_eval(
    engine: Engine,
    env: Environment,
    n: int,
    params: SamplingParams,
    batch_size: int,
    progress: Progress | None = None,
    show: int = 0,
) -> dict:
    tasks = list(env.tasks("test"))[:n]
    figures = evaluate(engine, env, tasks, params, batch_size, seed=0, progress=progress, show=show)
    figures["temperature"] = params.temperature
    return figures


def model_engine(path: str, engine: str = "torch") -> Engine:
    return load_engine(path, "int8", "cpu", engine=engine)


class EvalDuring:
    """Held-out evals of the newest version while the run trains, for the
    report's learning curve: at every multiple of `every` versions, one at a
    time in a background thread of the launcher (a mark passed while one runs
    is taken at the next version after it). Each lands under
    `report/eval-during/`; one that fails is logged and skipped: it never
    stops the run.
    """

    def __init__(
        self,
        store: ObjectStore,
        env: Environment,
        n: int,
        params: SamplingParams,
        batch_size: int,
        every: int,
        engine: str = "torch",
        said: Callable[[dict], None] | None = None,
    ):
        self.store, self.env, self.n, self.params = store, env, n, params
        self.batch_size, self.every, self.engine, self.said = batch_size, every, engine, said
        self.next = every
        self.thread: threading.Thread | None = None

    def poll(self, version: int) -> None:
        """Start an eval of `version` if a mark is reached and none is running."""
        if self.every <= 0 or self.n <= 0 or version < self.next:
            return
        if self.thread is not None and self.thread.is_alive():
            return
        self.next = (version // self.every + 1) * self.every
        self.thread = threading.Thread(
            target=self._run, args=(version,), name=f"eval-v{version}", daemon=True
        )
        self.thread.start()

    def _run(self, version: int) -> None:
        try:
            engine = version_engine(self.store, version, self.engine)
            figures = run_eval(engine, self.env, self.n, self.params, self.batch_size)
            figures["version"] = version
            self.store.put(keys.eval_during_key(version), json.dumps(figures).encode())
        # Retention may have moved past the version; the store may be out.
        except (StoreError, VersionError, OSError, ValueError) as e:
            log.warning("held-out eval of v%d skipped: %s", version, e)
            return
        if self.said is not None:
            self.said(figures)

    def close(self, timeout: float = 600.0) -> None:
        """Wait for the eval in flight (the final eval follows it on the same cores)."""
        if self.thread is not None:
            self.thread.join(timeout)
