"""One simulated run: the real trainer in this thread, a fleet of simulated
workers in others, all on one local store seen through `WanStore` views.

`run_fleet` is what `cli.run` calls for the main run and the baseline: it
registers every worker's key up front, starts the `Fleet` under the
fleet-wide shortcuts of `sim_worker`, closes a version (a `Mark` of every
counter) each time the trainer writes `latest.json`, churns the fleet there,
and after the trainer stops measures a joiner's catch-up. The `RunResult` it
returns is read by `analysis`.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .options import FleetOptions
from .sim_worker import Policy, shared_decode, shared_model, worker_class
from .wan import Link, Tally, WanStore

if TYPE_CHECKING:
    from colonnade.protocol.metrics import TrainerRow

WORKER_PREFIX = "sim-"
JOINER = "joiner"


# -- the fleet ---------------------------------------------------------------------------


class Fleet:
    """Simulated workers, each in its own thread, joining and leaving."""

    def __init__(self, inner, tally: Tally, opts: FleetOptions, keydir: Path, policy: Policy):
        self.inner, self.tally, self.opts = inner, tally, opts
        self.keydir, self.policy = keydir, policy
        self.rng = random.Random(opts.seed)
        self.cls = worker_class()
        self.workers: dict[str, Any] = {}  # id -> SimWorker, once built
        self.threads: dict[str, threading.Thread] = {}
        self.errors: dict[str, str] = {}
        self.next_id = 0
        self._owed = 0.0  # fractional churn carried to the next version
        self._lock = threading.Lock()

    def link(self) -> Link:
        return Link(self.opts.latency_ms / 1e3, self.opts.bandwidth_mbit)

    def build(self, wid: str):
        from colonnade.config import WorkerConfig

        cfg = WorkerConfig(id=wid, key=str(self.keydir / f"{wid}.key"), join_timeout=600.0)
        store = WanStore(self.inner, wid, self.tally, self.link())
        return self.cls(cfg, store, self.policy, self.opts.gen_seconds)

    def _run(self, wid: str) -> None:
        try:
            w = self.build(wid)  # in the thread: its first listing pays the latency here
            with self._lock:
                self.workers[wid] = w
            w.run()
        except Exception as e:  # recorded and reported; the fleet goes on
            self.errors[wid] = f"{type(e).__name__}: {e}"

    def start(self, n: int) -> None:
        for _ in range(n):
            wid = worker_id(self.next_id)
            self.next_id += 1
            t = threading.Thread(target=self._run, args=(wid,), name=wid, daemon=True)
            self.threads[wid] = t
            t.start()

    def live(self) -> list[str]:
        with self._lock:
            return [w for w, x in self.workers.items()
                    if self.threads[w].is_alive() and not x.stop.requested]  # fmt: skip

    def churn(self) -> tuple[int, int]:
        """Replace `churn` of the fleet: leavers finish their batch, joiners
        start from nothing; (left, joined)."""
        self._owed += self.opts.churn * self.opts.workers
        n, self._owed = int(self._owed), self._owed - int(self._owed)
        live = self.live()
        leaving = self.rng.sample(live, min(n, len(live)))
        for wid in leaving:
            self.workers[wid].stop.requested = True
        self.start(len(leaving))
        return len(leaving), len(leaving)

    def stop_all(self, timeout: float) -> None:
        for w in list(self.workers.values()):
            w.stop.requested = True
        deadline = time.monotonic() + timeout
        for t in self.threads.values():
            t.join(max(0.0, deadline - time.monotonic()))

    def follower_anchors(self) -> int:
        """Anchors the workers downloaded after their first (joining) one."""
        snap = self.tally.snapshot()["anchors"]
        return sum(max(0, n - 1) for c, n in snap.items() if c.startswith(WORKER_PREFIX))


def worker_id(i: int) -> str:
    return f"{WORKER_PREFIX}{i:04d}"


def planned_ids(opts: FleetOptions) -> list[str]:
    """Every worker id the run may use (its keys are registered up front)."""
    joiners = math.ceil(opts.churn * opts.workers) * (opts.versions + 1)
    return [worker_id(i) for i in range(opts.workers + joiners)]


# -- one run -----------------------------------------------------------------------------


@dataclass
class Mark:
    """The counters when a version was published (latest.json written)."""

    version: int
    time: float
    tally: dict
    live: int
    objects: Counter  # top-level prefix -> objects
    bytes: int
    left: int = 0
    joined: int = 0


@dataclass
class RunResult:
    opts: FleetOptions
    marks: list[Mark]
    rows: list[TrainerRow]
    tally: Tally
    joiner: dict
    errors: dict[str, str]
    seconds: float
    follower_anchors: int
    stopped_early: bool = False
    extra: dict = field(default_factory=dict)


def store_objects(root: Path) -> tuple[Counter, int]:
    """(objects per top-level prefix, total bytes) of a local store, read
    from the disk directly (no request counted)."""
    objects: Counter = Counter()
    total = 0
    for dirpath, _, files in os.walk(root):
        top = Path(dirpath).relative_to(root).parts[:1]
        for f in files:
            try:
                total += (Path(dirpath) / f).stat().st_size
            except FileNotFoundError:  # deleted or renamed meanwhile
                continue
            objects[top[0] if top else f] += 1
    return objects, total


def trainer_config(opts: FleetOptions, root: Path, keydir: Path):
    from colonnade.config import TrainerConfig
    from colonnade.config.presets import TRAINER_PRESETS

    return TrainerConfig(**{
        **TRAINER_PRESETS["smoke"],
        "store": str(root / "store"),
        "model": opts.model,
        "staging_dir": str(root / "staging"),
        "max_versions": opts.versions,
        "max_lag": opts.max_lag,
        "anchor_every": opts.anchor_every,
        "group_size": opts.group_size,
        "groups_per_step": opts.groups_per_step,
        "groups_per_batch": opts.groups_per_batch,
        "worker_keys": str(keydir),
        "quarantine_factor": 0.0,  # made-up log-probs: every worker would drift
        "spot_rate": 0.0,  # made-up tokens: every row checked would prove a forgery
        "seed": opts.seed,
    })  # fmt: skip


def run_fleet(opts: FleetOptions, root: Path, wrap=None) -> RunResult:
    """One simulated run in `root`: the trainer in this thread, the fleet in
    others. `wrap(store)`, if given, goes between the clients' views and the
    local store (a test counts there what the views counted)."""
    from colonnade.model import load_model
    from colonnade.protocol import keys
    from colonnade.protocol.schemas import Latest, loads
    from colonnade.protocol.signing import new_keypair
    from colonnade.store import LocalStore
    from colonnade.telemetry import read_trainer_rows
    from colonnade.train.trainer import Trainer

    keydir = root / "keys"
    for wid in [*planned_ids(opts), JOINER]:
        new_keypair(wid, keydir)
    local = LocalStore(root / "store")
    inner = wrap(local) if wrap is not None else local
    tally = Tally()
    marks: list[Mark] = []
    fleet: Fleet | None = None

    def on_write(key: str, data: bytes) -> None:
        if key != keys.LATEST:
            return
        v = Latest.from_dict(loads(data)["doc"]).version
        if marks and marks[-1].version >= v:
            return  # the pointer rewritten at the end (done)
        left = joined = 0
        if fleet is not None and v > 0:
            left, joined = fleet.churn()
        objects, total = store_objects(local.root)
        live = len(fleet.live()) if fleet is not None else 0
        marks.append(Mark(v, time.monotonic(), tally.snapshot(), live, objects, total,
                          left, joined))  # fmt: skip

    store = WanStore(inner, "trainer", tally, Link(opts.latency_ms / 1e3), on_write)
    trainer = Trainer(trainer_config(opts, root, keydir), store=store)
    policy = Policy(trainer.tok, trainer.env)
    fleet = Fleet(inner, tally, opts, keydir, policy)
    skeleton, _ = load_model(str(trainer.model_dir))
    t0 = time.monotonic()
    with shared_model(skeleton, trainer.tok):
        with shared_decode() as decode:
            fleet.start(opts.workers)
            watchdog = _watch(trainer, fleet, opts.timeout)
            trainer.run()
            watchdog.set()
            fleet.stop_all(timeout=60.0)
            seconds = time.monotonic() - t0
        # Outside the shared decode: the joiner decodes its patches itself.
        joiner = measure_joiner(fleet, inner, tally, opts)
    return RunResult(
        opts, marks, read_trainer_rows(local, trainer.signer.trust), tally, joiner,
        dict(fleet.errors), seconds,
        fleet.follower_anchors(), stopped_early=trainer.version < opts.versions,
        extra={"patches_decoded": decode.decoded, "patch_decodes_shared": decode.shared},
    )  # fmt: skip


def _watch(trainer, fleet: Fleet, timeout_s: float) -> threading.Event:
    """Stop the trainer (it checkpoints and returns) past `timeout_s`, or once
    every worker has died: a broken fleet must not leave it waiting forever."""
    done = threading.Event()

    def watch() -> None:
        t0 = time.monotonic()
        while not done.wait(1.0):
            dead = len(fleet.errors) >= len(fleet.threads) > 0
            if dead or time.monotonic() - t0 > timeout_s:
                trainer.stop_requested = True
                return

    threading.Thread(target=watch, name="watchdog", daemon=True).start()
    return done


def measure_joiner(fleet: Fleet, inner, tally: Tally, opts: FleetOptions) -> dict:
    """A worker joining after the last version: from nothing to running the
    newest version, over one worker's link. Bytes count everything it read
    (run.json, model files, the pointer, the anchor, the patches)."""
    from colonnade.config import WorkerConfig

    cfg = WorkerConfig(id=JOINER, key=str(fleet.keydir / f"{JOINER}.key"))
    t0 = time.monotonic()
    w = fleet.cls(cfg, WanStore(inner, JOINER, tally, fleet.link()), fleet.policy, 0.0)
    w.setup()
    w.sync()  # the first sync: synchronous, before any generation
    seconds = time.monotonic() - t0
    read = tally.snapshot()["down"][JOINER]
    w.weights.close()  # the next fetch sync() queued: not part of catching up
    f = w.weights.follower
    return {
        "version": f.version,
        "bytes": read,
        "weight_bytes": f.bytes_read,
        "anchors": f.anchors_read,
        "patches": f.version - (f.version - f.version % opts.anchor_every),
        "seconds": round(seconds, 2),
    }
