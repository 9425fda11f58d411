"""`colonnade bench fleet`: the store protocol at fleet scale, on a simulated WAN.

One process runs the real trainer (tiny model, smoke environment) and a
fleet of simulated workers, one thread each. A simulated worker is the real
`Worker`: it reads run.json and the model files, follows the versions with
the real `Follower` (anchor on joining, a PULSE patch per version after),
paces or claims work however the worker does, and uploads signed batches
that the trainer verifies, replays and trains on. Only the model is gone:
its engine is a stand-in that holds the version, and `make_batch` writes
valid smoke episodes (the answer tokens, right or not) after sleeping
`--gen-seconds` for the generation it stands for. So 200 workers fit on 2
cores; each still holds its own follower state (~1.7 MB, tiny int8).

Every client sees the store through its own `WanStore` (`fleet_store`):
requests counted by verb, one round trip of `--latency-ms` each, payloads
over a `--bandwidth-mbit` line per worker. `--churn` replaces that share of
the fleet at each version (leavers finish their batch; joiners have fresh
ids and keys registered in advance). After the run a joiner catches up from
nothing, timed over the same link.

Per version and in total it reports requests per worker by verb, bytes
downloaded per worker, anchor downloads by following workers (a worker's
downloads after its first), waste (uploaded groups never trained on over
uploaded), the trainer's wait, objects and bytes in the store; then the
joiner's catch-up, the same run with `--baseline-workers` for the trainer's
wait side by side, and a cost model for a 4B model and 100 workers on R2
and S3 (docs/benchmarks.md, issue 21).

Simplifications, said once: the trainer shares the workers' process (and
their GIL) and pays the same latency with no bandwidth cap; behaviour
log-probs are made up, so the quarantine is off (`quarantine_factor` 0) and
the DPPO gate masks what it masks; one tokenizer and environment are shared
by every worker's policy, each worker's own model skeleton is dropped after
setup.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colonnade.config.flags import add_flags, flag_values
from colonnade.config.loading import setting

from .fleet_store import VERBS, Link, Tally, WanStore

if TYPE_CHECKING:
    from colonnade.protocol.metrics import TrainerRow

WORKER_PREFIX = "sim-"
JOINER = "joiner"
# Issue 21's targets.
TARGETS = {"follower_anchor_downloads": 0, "requests_per_worker_per_version": 5.0,
           "waste_fraction": 0.10}  # fmt: skip
# Request and storage prices for the cost model: list prices as published on
# the providers' pricing pages in 2024-2025 (R2: Cloudflare R2 pricing; S3:
# S3 Standard, us-east-1), not re-checked when this was written (2026-12).
PRICES = {
    "r2": {"class_a": 4.50e-6, "class_b": 0.36e-6, "egress_gb": 0.0, "storage_gb_month": 0.015},
    "s3": {"class_a": 0.005e-3, "class_b": 0.0004e-3, "egress_gb": 0.09,
           "storage_gb_month": 0.023},
}  # fmt: skip
PRICES_AS_OF = "list prices published 2024-2025, not re-checked 2026-12"
CLASS_A = ("put", "put_if_absent", "put_file", "list")  # writes and listings
CLASS_B = ("get", "size", "get_file")  # reads and HEADs (deletes are free on both)


@dataclass
class FleetOptions:
    workers: int = setting(200, "simulated workers")
    versions: int = setting(50, "versions to train")
    latency_ms: float = setting(
        80.0, "round trip added to every store request (trainer and workers)"
    )
    bandwidth_mbit: float = setting(50.0, "each worker's link to the store, Mbit/s (0: unlimited)")
    churn: float = setting(0.0, "share of the fleet replaced by fresh workers at each version")
    gen_seconds: float = setting(0.5, "seconds a simulated batch's generation takes (slept)")
    groups_per_step: int = setting(16, "groups the trainer takes per version")
    groups_per_batch: int = setting(2, "groups per worker upload")
    group_size: int = setting(4, "episodes per group")
    max_lag: int = setting(2, "oldest usable policy: v - max_lag")
    anchor_every: int = setting(10, "versions between anchors")
    model: str = setting("tiny", "the trainer's model (preset or directory)")
    seed: int = setting(0, "seed of the simulated policy and of churn")
    timeout: float = setting(3600.0, "stop the trainer after this many seconds per run")

    def check(self) -> None:
        bad = [name for name, ok in (
            ("--workers >= 1", self.workers >= 1),
            ("--versions >= 2", self.versions >= 2),
            ("--latency-ms >= 0", self.latency_ms >= 0),
            ("--bandwidth-mbit >= 0", self.bandwidth_mbit >= 0),
            ("--churn in [0, 1]", 0 <= self.churn <= 1),
            ("--gen-seconds >= 0", self.gen_seconds >= 0),
            ("--groups-per-step >= 1", self.groups_per_step >= 1),
            ("--groups-per-batch >= 1", self.groups_per_batch >= 1),
            ("--group-size >= 2", self.group_size >= 2),
            ("--max-lag >= 0", self.max_lag >= 0),
            ("--anchor-every >= 1", self.anchor_every >= 1),
            ("--timeout > 0", self.timeout > 0),
        ) if not ok]  # fmt: skip
        if bad:
            raise ValueError(f"out of range: {'; '.join(bad)}")


# -- the simulated worker ----------------------------------------------------------------


class Policy:
    """Smoke episodes without a model: the answer tag around the task's word
    (right with probability `right`, else another colour or 'unsure'), as
    tokens the trainer decodes, replays and scores like any other."""

    def __init__(self, tokenizer, env, right: float = 0.5) -> None:
        from colonnade.envs.smoke import COLOURS, UNSURE

        self.tok, self.env, self.right = tokenizer, env, right
        words = (*COLOURS, UNSURE)
        self.answers = {
            w: tokenizer.encode(f"<answer> {w}</answer>", add_special_tokens=False) for w in words
        }

    def episode(self, task, rng: random.Random):
        from colonnade.protocol import EpisodeRecord

        word = task.answers[0]
        if rng.random() >= self.right:
            word = rng.choice([w for w in self.answers if w != word])
        ids = self.answers[word]
        # Made-up behaviour log-probs (<= 0, as the schema requires).
        logps = [round(-rng.uniform(0.01, 1.5), 4) for _ in ids]
        return EpisodeRecord(list(ids), [True] * len(ids), logps, "done")


class SimEngine:
    """The engine's contract as far as the worker loop reads it: a version and a name."""

    name = "torch"

    def __init__(self, version: int) -> None:
        self.version = version


def _worker_class():
    """SimWorker, built on first use: the role module imports torch."""
    from colonnade.rollout.worker import Stop, Worker

    class ThreadStop(Stop):
        """Stop without signal handlers: a worker thread cannot install them;
        the bench sets `requested` to make a worker leave."""

        def install(self) -> None:
            pass

    class SimWorker(Worker):
        """The real worker loop with generation replaced by `Policy`."""

        def __init__(self, cfg, store, policy: Policy, gen_seconds: float) -> None:
            super().__init__(cfg, store)
            self.stop = ThreadStop()
            self.policy, self.gen_seconds = policy, gen_seconds

        def _load_weights(self, changed: set[str] | None = None) -> None:
            # What engine_for / refresh do, minus the model: hold the version
            # the follower verified.
            if self.engine is None:
                self.engine = SimEngine(self.follower.version)
            self.engine.version = self.follower.version

        def make_batch(self):
            from colonnade.protocol import GroupRecord, RolloutBatch

            v = self.engine.version
            rng = random.Random(f"{self.cfg.seed}/{self.id}/{v}/{self.seq}")
            chosen = rng.sample(self.tasks, min(self.spec.groups_per_batch, len(self.tasks)))
            groups = [
                GroupRecord(
                    t.id, [self.policy.episode(t, rng) for _ in range(self.spec.group_size)]
                )
                for t in chosen
            ]
            time.sleep(self.gen_seconds)  # the generation this batch stands for
            return RolloutBatch(self.id, v, self.seq, groups, {"reward_claimed": 0.0},
                                engine=SimEngine.name)  # fmt: skip

    return SimWorker


class SharedDecode:
    """Stands in for the `pulse` module inside `protocol.weights` while the
    fleet runs, so that a patch is decoded once for the whole fleet.

    Every worker still downloads each patch and the Follower checks it as
    always; only `apply` onto a base whose hash the follower knows is shared:
    the first worker to ask decodes (and verifies the result's hash), the
    others get the same tensors. Without it 200 workers decoding every patch
    took the 2 cores from the trainer. Everything else is the real module.
    """

    def __init__(self, real, keep: int = 64) -> None:
        self._real, self._keep = real, keep
        self._done: dict[tuple[str, str], dict] = {}
        self._busy: dict[tuple[str, str], threading.Lock] = {}
        self._lock = threading.Lock()
        self.decoded = self.shared = 0

    def __getattr__(self, name: str):
        return getattr(self._real, name)

    def apply(self, base, patch, *, base_hash: str | None = None, in_place: bool = False):
        # Never in place: the fleet's followers share one copy of each state,
        # which one of them must not rewrite under the others.
        if base_hash is None:
            return self._real.apply(base, patch, base_hash=base_hash)
        key = (base_hash, self._real.read_header(patch)["result_hash"])
        with self._lock:
            busy = self._busy.setdefault(key, threading.Lock())
        with busy:  # the first caller decodes; the others wait for its result
            if key not in self._done:
                result = self._real.apply(base, patch, base_hash=base_hash)
                with self._lock:
                    self._done[key] = result
                    self.decoded += 1
                    while len(self._done) > self._keep:
                        old = next(iter(self._done))
                        self._done.pop(old)
                        self._busy.pop(old, None)
                return dict(result)
            self.shared += 1
            return dict(self._done[key])


@contextlib.contextmanager
def shared_decode():
    """`SharedDecode` installed in protocol.weights for the duration."""
    from colonnade.protocol import weights

    real = weights.pulse
    weights.pulse = shim = SharedDecode(real)
    try:
        yield shim
    finally:
        weights.pulse = real


@contextlib.contextmanager
def shared_model(model, tokenizer):
    """Workers' `fetch_model` for the duration: each worker still downloads
    the run's model files (counted like any request), but gets the one
    skeleton and tokenizer built here instead of initialising its own (a
    random init of the tiny model each: most of 200 workers' start-up CPU)."""
    from colonnade.protocol import keys
    from colonnade.protocol.model_files import MODEL_FILE_LIMIT
    from colonnade.rollout import worker as worker_module

    def fetch(store, spec):
        for name in spec.model_files:
            store.get(keys.model_file(name), max_bytes=MODEL_FILE_LIMIT)
        return model, tokenizer

    real = worker_module.fetch_model
    worker_module.fetch_model = fetch
    try:
        yield
    finally:
        worker_module.fetch_model = real


# -- the fleet ---------------------------------------------------------------------------


class Fleet:
    """Simulated workers, each in its own thread, joining and leaving."""

    def __init__(self, inner, tally: Tally, opts: FleetOptions, keydir: Path, policy: Policy):
        self.inner, self.tally, self.opts = inner, tally, opts
        self.keydir, self.policy = keydir, policy
        self.rng = random.Random(opts.seed)
        self.cls = _worker_class()
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

        cfg = WorkerConfig(id=wid, key=str(self.keydir / f"{wid}.key"), seed=self.opts.seed,
                           join_timeout=600.0)  # fmt: skip
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

    cfg = WorkerConfig(id=JOINER, key=str(fleet.keydir / f"{JOINER}.key"), seed=opts.seed)
    t0 = time.monotonic()
    w = fleet.cls(cfg, WanStore(inner, JOINER, tally, fleet.link()), fleet.policy, 0.0)
    w.setup()
    w.sync()  # the first sync: synchronous, before any generation
    seconds = time.monotonic() - t0
    read = tally.snapshot()["down"][JOINER]
    w.prefetch.close()  # the next fetch sync() queued: not part of catching up
    f = w.follower
    return {
        "version": f.version,
        "bytes": read,
        "weight_bytes": f.bytes_read,
        "anchors": f.anchors_read,
        "patches": f.version - (f.version - f.version % opts.anchor_every),
        "seconds": round(seconds, 2),
    }


# -- figures -------------------------------------------------------------------------------


def warmup(opts: FleetOptions) -> int:
    """The version from which the store should be flat: retention keeps the
    newest anchor's window and the one before it (and max_lag of rollouts),
    so the count repeats from two anchor windows on; half the run if shorter."""
    return min(2 * opts.anchor_every + opts.max_lag, opts.versions // 2)


def _workers(counter: dict) -> dict:
    return {c: n for c, n in counter.items() if c.startswith(WORKER_PREFIX)}


def _verbs(snap: dict) -> Counter:
    out: Counter = Counter()
    for n in _workers(snap["requests"]).values():
        out.update(n)
    return out


def _follower_anchors(snap: dict) -> int:
    return sum(max(0, n - 1) for n in _workers(snap["anchors"]).values())


def _down(snap: dict) -> int:
    return sum(_workers(snap["down"]).values())


def trained_by_source(rows: list[TrainerRow]) -> Counter:
    """Groups trained on per policy version that made them (a row of version
    V trained on groups of V - 1 - lag)."""
    out: Counter = Counter()
    for r in rows:
        for lag, n in r.staleness.items():
            out[r.version - 1 - int(lag)] += n
    return out


def per_version(res: RunResult) -> list[dict]:
    """One row per published version v >= 1: the fleet's requests and bytes
    between v-1 and v, per worker; the groups made with v's policy and
    trained on; the trainer's step making v; the store after v."""
    rows = {r.version: r for r in res.rows}
    trained = trained_by_source(res.rows)
    final = res.tally.snapshot()
    n = res.opts.workers
    out = []
    for prev, m in zip(res.marks, res.marks[1:], strict=False):
        verbs = _verbs(m.tally) - _verbs(prev.tally)
        made = final["uploads"][m.version] * res.opts.groups_per_batch
        r = rows.get(m.version)
        out.append({
            "version": m.version,
            "workers": m.live,
            "left": m.left,
            "joined": m.joined,
            "requests_per_worker": round(sum(verbs.values()) / n, 2),
            "by_verb": {v: round(verbs[v] / n, 2) for v in VERBS if verbs[v]},
            "down_per_worker": round((_down(m.tally) - _down(prev.tally)) / n),
            "follower_anchor_downloads": _follower_anchors(m.tally) - _follower_anchors(prev.tally),
            "groups_made": made,
            "groups_trained": trained[m.version],
            "trainer_wait_s": r.wait_seconds if r else None,
            "trainer_step_s": r.step_seconds if r else None,
            "objects": sum(m.objects.values()),
            "store_bytes": m.bytes,
        })  # fmt: skip
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def summarize(res: RunResult) -> dict:
    """The totals and the steady-state figures of one run (issue 21's keys)."""
    o, marks = res.opts, res.marks
    warm = min(warmup(o), len(marks) - 2)
    at = {m.version: m for m in marks}
    first, last = at.get(warm, marks[0]), marks[-1]
    span = max(1, last.version - first.version) * o.workers
    verbs = _verbs(last.tally) - _verbs(first.tally)
    trainer_verbs = Counter(last.tally["requests"].get("trainer", {}))
    trainer_verbs.subtract(first.tally["requests"].get("trainer", {}))
    final = res.tally.snapshot()
    made = sum(final["uploads"].values()) * o.groups_per_batch
    trained = trained_by_source(res.rows)
    closed = last.version - 1 - o.max_lag  # the newest version whose window closed in the run
    made_closed = sum(n for v, n in final["uploads"].items() if v <= closed) * o.groups_per_batch
    trained_closed = sum(n for v, n in trained.items() if v <= closed)
    steady_rows = res.rows[1:]  # the first step waits for the fleet to start
    objects = [sum(m.objects.values()) for m in marks if m.version >= warm]
    window = [_versioned(m) for m in marks if warm <= m.version < warm + o.anchor_every]
    later = [_versioned(m) for m in marks if m.version >= warm + o.anchor_every]
    patch = [r.patch_bytes for r in res.rows if r.patch_bytes]
    return {
        "workers": o.workers,
        "versions": last.version,
        "seconds": round(res.seconds, 1),
        "warmup_versions": warm,
        "follower_anchor_downloads": res.follower_anchors,
        "requests_per_worker_per_version": _ratio(sum(verbs.values()), span),
        "requests_per_worker_per_version_by_verb": {
            v: _ratio(verbs[v], span) for v in VERBS if verbs[v]
        },
        "trainer_requests_per_version_by_verb": {
            v: _ratio(trainer_verbs[v], max(1, last.version - first.version))
            for v in VERBS
            if trainer_verbs[v] > 0
        },
        # The polls among the gets: what pacing (polling.py) decides.
        "latest_polls_per_worker_per_version": _ratio(
            sum(_workers(last.tally["polls"]).values())
            - sum(_workers(first.tally["polls"]).values()),
            span,
        ),
        "down_bytes_per_worker_per_version": round((_down(last.tally) - _down(first.tally)) / span),
        "down_bytes_per_worker": round(_down(final) / max(1, len(_workers(final["down"])))),
        "groups_uploaded": made,
        "groups_trained": sum(trained.values()),
        "waste_fraction": round(max(0.0, 1 - sum(trained.values()) / made), 4) if made else 0.0,
        "waste_fraction_closed_windows": (
            round(max(0.0, 1 - trained_closed / made_closed), 4) if made_closed else 0.0
        ),
        "trainer_wait_fraction": _wait(steady_rows),
        "trainer_wait_fraction_all": _wait(res.rows),
        "objects_after_warmup": objects[0] if objects else 0,
        "objects_peak": max(objects, default=0),
        "objects_end": sum(last.objects.values()),
        "objects_end_by_prefix": dict(sorted(last.objects.items())),
        # Without the per-worker documents (a heartbeat and metric segments per
        # worker that ever made a batch: bounded by the fleet, not the versions).
        "versioned_objects_first_window_peak": max(window, default=0),
        "versioned_objects_later_peak": max(later, default=0),
        "per_worker_objects_end": sum(last.objects.values()) - _versioned(last),
        "store_bytes_end": last.bytes,
        "patch_bytes_mean": round(sum(patch) / len(patch)) if patch else 0,
        "full_bytes": res.rows[-1].full_bytes if res.rows else 0,
        "joiner_bytes": res.joiner["bytes"],
        "joiner_weight_bytes": res.joiner["weight_bytes"],
        "joiner_seconds": res.joiner["seconds"],
        "joiner": res.joiner,
        "worker_errors": len(res.errors),
        **res.extra,
        "stopped_early": res.stopped_early,
    }


PER_WORKER = ("workers", "metrics")  # top-level prefixes of per-process documents


def _versioned(m: Mark) -> int:
    return sum(n for prefix, n in m.objects.items() if prefix not in PER_WORKER)


def _wait(rows: list[TrainerRow]) -> float:
    step = sum(r.step_seconds for r in rows)
    return round(sum(r.wait_seconds for r in rows) / step, 4) if step else 0.0


def joiner_bound(s: dict, anchor_every: int) -> dict:
    """What a joiner downloads at any version, e.g. v1,000: the newest anchor
    and at most K - 1 patches (the worst case is the version before an anchor)."""
    anchor, patch = s["full_bytes"], s["patch_bytes_mean"]
    return {
        "anchor_plus_patches_worst_bytes": anchor + (anchor_every - 1) * patch,
        "at_version_1000_bytes": anchor + (1000 % anchor_every) * patch,
    }


# -- the cost model ----------------------------------------------------------------------

GB = 1e9
PARAMS_4B = 4e9
# bytes per parameter: int8 published weights (what workers download; the row
# scales are ~0.1%), and a checkpoint (fp32 master weights + two Adam moments).
INT8_BYTES, CKPT_BYTES = 1.0, 12.0
# The int8 patch of a real model at a real rate, as a fraction of its int8
# state: SmolLM2-135M at lr 1e-5 in the PULSE table of docs/benchmarks.md
# (int8 patch bytes over half the bf16 full bytes). The tiny model at the
# smoke preset's 3e-4 changes far more of its codes per step.
SMOLLM2_PATCH_FRACTION = 44_327 / (269_060_520 / 2)


def cost_model(s: dict, opts: FleetOptions, workers: int = 100, versions: int = 1000,
               version_seconds: float = 60.0, keep_checkpoints: int = 2,
               checkpoint_every: int = 5, part_bytes: float = 64 * 2**20,
               patch_fraction: float | None = None) -> dict:  # fmt: skip
    """Dollars per `versions` versions for a 4B model and `workers` workers,
    from this run's per-worker requests and its patch fraction (patch bytes
    over the full int8 state), scaled to 4B parameters.

    Requests: the workers' measured steady-state verbs; the trainer's measured
    ones plus the multipart parts a 4B anchor and checkpoint take (the tiny
    model's fit in one PUT). Egress: each worker's patch per version plus the
    small documents it read (measured bytes less the tiny patch). Storage:
    what retention keeps (two anchors, two anchor windows of patches, the
    kept checkpoints) for the run's duration at `version_seconds` a version.
    `patch_fraction` replaces the measured one (e.g. SMOLLM2_PATCH_FRACTION).
    """
    full = PARAMS_4B * INT8_BYTES
    fraction = s["patch_bytes_mean"] / s["full_bytes"] if s["full_bytes"] else 0.0
    if patch_fraction is not None:
        fraction = patch_fraction
    patch = fraction * full
    docs = max(0.0, s["down_bytes_per_worker_per_version"] - s["patch_bytes_mean"])
    w = s["requests_per_worker_per_version_by_verb"]
    t = s["trainer_requests_per_version_by_verb"]
    ckpt_parts = math.ceil(PARAMS_4B * CKPT_BYTES / part_bytes) + 2  # + create, complete
    anchor_parts = math.ceil(full / part_bytes) + 2
    extra_a = ckpt_parts / checkpoint_every + anchor_parts / opts.anchor_every
    class_a = versions * (workers * sum(w.get(v, 0) for v in CLASS_A)
                          + sum(t.get(v, 0) for v in CLASS_A) + extra_a)  # fmt: skip
    class_b = versions * (workers * sum(w.get(v, 0) for v in CLASS_B)
                          + sum(t.get(v, 0) for v in CLASS_B))  # fmt: skip
    egress_gb = versions * workers * (patch + docs) / GB
    kept_gb = (2 * full + 2 * opts.anchor_every * patch
               + keep_checkpoints * PARAMS_4B * CKPT_BYTES) / GB  # fmt: skip
    months = versions * version_seconds / (30 * 86400)
    out = {
        "assumptions": {
            "params": PARAMS_4B, "workers": workers, "versions": versions,
            "version_seconds": version_seconds, "patch_fraction": round(fraction, 5),
            "patch_bytes_4b": round(patch), "prices": PRICES_AS_OF,
        },
        "class_a_requests": round(class_a), "class_b_requests": round(class_b),
        "egress_gb": round(egress_gb, 1), "stored_gb": round(kept_gb, 1),
    }  # fmt: skip
    for name, p in PRICES.items():
        parts = {
            "class_a": class_a * p["class_a"],
            "class_b": class_b * p["class_b"],
            "egress": egress_gb * p["egress_gb"],
            "storage": kept_gb * months * p["storage_gb_month"],
        }
        out[name] = {k: round(v, 2) for k, v in parts.items()} | {
            "total": round(sum(parts.values()), 2)
        }
    return out


# -- the command --------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, FleetOptions)
    p.add_argument(
        "--baseline-workers",
        type=int,
        default=2,
        help="also run this many workers (no churn) for the trainer's wait side by side "
        "(0: skip; default 2)",
    )
    p.add_argument(
        "--out", type=Path, help="keep the runs' stores here (default: a temporary folder)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")


def options(args: argparse.Namespace, workers: int | None = None, churn: float | None = None):
    """The options of one run from the flags given (a flag left out keeps its
    default), with `workers` and `churn` overridden for the baseline run."""
    opts = FleetOptions(**flag_values(args, [f.name for f in fields(FleetOptions)]))
    if workers is not None:
        opts.workers = workers
    if churn is not None:
        opts.churn = churn
    opts.check()
    return opts


def log(msg: str) -> None:
    print(f"[bench fleet] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        main_opts = options(args)
        base = options(args, args.baseline_workers, 0.0) if args.baseline_workers else None
        if args.baseline_workers < 0:
            raise ValueError("out of range: --baseline-workers >= 0")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)  # one line, exit 2, as the CLI's own errors
        return 2
    root = args.out or Path(tempfile.mkdtemp(prefix="colonnade-bench-fleet-"))
    log(f"{main_opts.workers} workers, {main_opts.versions} versions, in {root}")
    res = run_fleet(main_opts, root / f"fleet-{main_opts.workers}")
    table = per_version(res)
    summary = summarize(res)
    if base is not None:
        log(f"baseline: {base.workers} workers")
        b = summarize(run_fleet(base, root / f"fleet-{base.workers}"))
        summary["baseline"] = {k: b[k] for k in (
            "workers", "trainer_wait_fraction", "trainer_wait_fraction_all",
            "requests_per_worker_per_version", "waste_fraction", "seconds")}  # fmt: skip
    summary["joiner_bound"] = joiner_bound(summary, main_opts.anchor_every)
    summary["cost_per_1000_versions"] = cost_model(summary, main_opts)
    summary["cost_per_1000_versions_smollm2_patch"] = cost_model(
        summary, main_opts, patch_fraction=SMOLLM2_PATCH_FRACTION
    )
    summary["targets"] = verdict(summary)
    print(render(table, summary))
    if args.json:
        print(json.dumps(summary))
    return 0


def verdict(s: dict) -> dict:
    """Each of issue 21's targets: met or not."""
    out = {
        "follower_anchor_downloads_0": s["follower_anchor_downloads"] == 0,
        "requests_per_worker_per_version_le_5": s["requests_per_worker_per_version"] <= 5.0,
        "waste_le_10pct": s["waste_fraction"] <= 0.10,
        # No growth from one anchor window to the next (10% for the rollouts in
        # flight), per-worker documents aside.
        "objects_flat_after_warmup": s["versioned_objects_later_peak"]
        <= 1.1 * s["versioned_objects_first_window_peak"],
    }
    if "baseline" in s:
        out["trainer_wait_no_worse_than_baseline"] = (
            s["trainer_wait_fraction"] <= s["baseline"]["trainer_wait_fraction"]
        )
    return out


def render(table: list[dict], s: dict) -> str:
    """The per-version table, then the totals, the joiner, the cost model."""
    lines = [
        f"{'v':>4}{'workers':>8}{'req/w':>7}{'get':>6}{'list':>6}{'put':>6}{'down/w B':>10}"
        f"{'anch':>5}{'made':>6}{'used':>6}{'wait s':>8}{'step s':>8}{'objects':>8}{'MB':>7}"
    ]
    for r in table:
        b = r["by_verb"]
        puts = b.get("put", 0) + b.get("put_if_absent", 0) + b.get("put_file", 0)
        lines.append(
            f"{r['version']:>4}{r['workers']:>8}{r['requests_per_worker']:>7.2f}"
            f"{b.get('get', 0) + b.get('get_file', 0) + b.get('size', 0):>6.2f}"
            f"{b.get('list', 0):>6.2f}{puts:>6.2f}{r['down_per_worker']:>10}"
            f"{r['follower_anchor_downloads']:>5}{r['groups_made']:>6}{r['groups_trained']:>6}"
            f"{_num(r['trainer_wait_s']):>8}{_num(r['trainer_step_s']):>8}{r['objects']:>8}"
            f"{r['store_bytes'] / 1e6:>7.1f}"
        )
    verbs = ", ".join(f"{v} {n}" for v, n in s["requests_per_worker_per_version_by_verb"].items())
    lines += [
        f"steady state (v{s['warmup_versions']}..v{s['versions']}): "
        f"{s['requests_per_worker_per_version']} requests per worker per version ({verbs}; "
        f"latest.json polls {s['latest_polls_per_worker_per_version']}); "
        f"{s['down_bytes_per_worker_per_version']} B down per worker per version",
        f"follower anchor downloads {s['follower_anchor_downloads']}; waste "
        f"{100 * s['waste_fraction']:.1f}% ({s['groups_trained']} of {s['groups_uploaded']} "
        f"groups trained; {100 * s['waste_fraction_closed_windows']:.1f}% over closed windows); "
        f"trainer wait {100 * s['trainer_wait_fraction']:.1f}% "
        f"(all {100 * s['trainer_wait_fraction_all']:.1f}%)",
        f"objects after warm-up {s['objects_after_warmup']}, peak {s['objects_peak']}, end "
        f"{s['objects_end']} ({s['store_bytes_end'] / 1e6:.1f} MB): {s['objects_end_by_prefix']}",
        f"joiner at v{s['joiner']['version']}: {s['joiner_bytes']} B in {s['joiner_seconds']} s "
        f"({s['joiner_weight_bytes']} B of weights: {s['joiner']['anchors']} anchor + "
        f"{s['joiner']['patches']} patches); any version: <= "
        f"{s['joiner_bound']['anchor_plus_patches_worst_bytes']} B of weights",
    ]
    if "baseline" in s:
        b = s["baseline"]
        lines.append(
            f"trainer wait: {100 * s['trainer_wait_fraction']:.1f}% with {s['workers']} workers, "
            f"{100 * b['trainer_wait_fraction']:.1f}% with {b['workers']}"
        )
    c, r = s["cost_per_1000_versions"], s["cost_per_1000_versions_smollm2_patch"]
    lines.append(
        f"cost per 1,000 versions, 4B model, 100 workers: R2 ${c['r2']['total']}, "
        f"S3 ${c['s3']['total']} with this run's patch fraction "
        f"({c['assumptions']['patch_fraction']}); R2 ${r['r2']['total']}, S3 "
        f"${r['s3']['total']} with SmolLM2's at lr 1e-5 ({c['assumptions']['prices']})"
    )
    lines.append("targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}"
                                         for k, v in s["targets"].items()))  # fmt: skip
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"
