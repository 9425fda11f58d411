"""The rollout worker: follow the newest weights, generate groups, upload them.

A worker knows only the store URL (and, best, the trainer's key: `--trust`).
It reads `run.json` (environment, sampling, group size, precision, the
trainer's key and the inbox), fetches the model's config and tokenizer from
`model/` (checked against run.json's hashes), then loops: sync to the
newest version (patches in order, verified by hash), claim a slot of the
trainer's demand for that version (`claims/{v}/{slot}` in the inbox,
put-if-absent; the demand comes with latest.json), run `groups_per_batch`
tasks × `group_size` episodes with the int8 engine (`make_batch`, the one
method a simulated worker replaces), upload the batch under
`{worker}/rollouts/{v}/{seq}` in the inbox, and heartbeat.

Everything the worker acts on is signed by the trainer's key; a document
that does not verify is ignored and counted (`unverified`, one log line per
kind), never acted on: no exit, no install, no quarantine. The version it
runs never goes backwards. It writes only to the inbox. With no slot to
claim it waits for latest.json to change, at the pace of the versions: the
fleet makes what the trainer will take (train/demand.py), not more. It
stops when the trainer writes `trainer/done.json`, or on SIGTERM / Ctrl-C
after the batch in flight is uploaded. Store outages are retried with
backoff and reported; the worker itself holds no state that matters, so
killing it loses at most one batch (and its claim lapses).

The worker composes parts of its own modules; none references the worker:

    tally     counts and seconds for the next metric row     tally.py
    watch     latest.json, done.json, quarantine.json         watch.py
    claims    slots of the demand, claimed in the inbox       claims.py
    pacer     the idle wait, at the pace of the versions      pacing.py
    weights   the follower and the engine: fetch, install     weights.py

`Worker.__init__` checks the settings and builds the tally; `setup` joins
the run (`Joined`) and builds the other parts (`wire`); `iteration` is one
turn of the loop.
"""

from __future__ import annotations

import logging
import os
import platform
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from colonnade.config import WorkerConfig
from colonnade.engine import SamplingParams, resolve_engine
from colonnade.envs import Environment, Task, load_environment
from colonnade.model import pick_device, tied_aliases
from colonnade.protocol import (
    EpisodeRecord,
    Follower,
    GroupRecord,
    RolloutBatch,
    RunSpec,
    VersionError,
    encode_batch,
    keys,
)
from colonnade.protocol.documents import WorkerHeartbeat
from colonnade.protocol.draws import batch_tasks, draw_key
from colonnade.protocol.inbox import open_inbox
from colonnade.protocol.model_files import ModelFileError, fetch_model
from colonnade.protocol.schemas import MAX_JSON_BYTES, ProtocolMismatch, SchemaError
from colonnade.protocol.signing import (
    Trust,
    load_private,
    read_run_envelope,
    sign,
    trusted_fingerprint,
)
from colonnade.store import NotFound, ObjectStore, StoreError, open_store
from colonnade.store.retry import backoff
from colonnade.telemetry import Exporter, Telemetry

from .claims import Claims
from .episodes import run_episodes, tool_figures
from .pacing import Pacer
from .tally import Tally
from .watch import Quarantined, Watch
from .weights import EngineLoader, Installed, Weights

__all__ = ["Joined", "Quarantined", "Stop", "Worker", "wait_for_run", "worker_for"]

log = logging.getLogger("colonnade.worker")
# A heartbeat this often from a thread of its own (and with the first
# batch), however long a batch takes or the worker waits for a slot: the
# trainer counts workers alive over `heartbeat_timeout`, and `colonnade
# status` calls a worker stalled by it.
HEARTBEAT_SECONDS = 20.0


class Stop:
    """Set by SIGTERM / SIGINT: finish the batch in flight, then exit."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        def handler(signum, frame):
            if self.requested:  # a second Ctrl-C: drop the batch in flight
                raise KeyboardInterrupt
            log.info("stopping after the batch in flight (signal %d)", signum)
            self.requested = True

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)


def wait_for_run(
    store: ObjectStore, timeout: float, poll: float, trusted: str | None
) -> tuple[RunSpec, Trust]:
    """run.json, signed by the key of fingerprint `trusted` (None: whichever
    key signs it; the caller pins it). A run.json that does not verify is
    waited past (the trainer writes its own again), up to `timeout`."""
    t0, said = time.monotonic(), set()
    while True:
        try:
            doc, trust = read_run_envelope(store.get(keys.RUN, max_bytes=MAX_JSON_BYTES), trusted)
            return RunSpec.from_dict(doc), trust
        except ProtocolMismatch:
            raise
        except (NotFound, SchemaError) as e:
            why = "missing" if isinstance(e, NotFound) else "unverified"
            if why not in said:
                if why == "missing":
                    log.info("waiting for run.json under %s (up to %.0f s)", store.url, timeout)
                else:
                    log.warning(
                        "run.json under %s does not verify (%s): ignored, waiting for "
                        "the trainer's",
                        store.url,
                        e,
                    )
                said.add(why)
            if time.monotonic() - t0 > timeout:
                raise TimeoutError(
                    f"no run.json signed by the trainer under {store.url} after {timeout:.0f} s"
                ) from None
            time.sleep(poll)


def worker_for(cfg: WorkerConfig) -> Worker:
    """The worker `cfg` asks for: the whole model's, or one stage of a
    pipeline group (`--stage K/N`, stageworker.py)."""
    if cfg.pipeline() is None:
        return Worker(cfg)
    from .stageworker import stage_worker

    return stage_worker(cfg)


@dataclass(frozen=True)
class Joined:
    """The run as this worker joined it: what `setup` read and opened."""

    spec: RunSpec
    inbox: ObjectStore  # where this worker writes (run.json names it)
    telemetry: Telemetry  # this worker's metric rows, in the inbox
    env: Environment
    tasks: list[Task]  # the environment's training tasks
    params: SamplingParams
    started: float  # seconds since the epoch


class Worker:
    """One worker process: its settings and identity, then the run it joined
    and the parts over it (the module docstring has the map)."""

    loader_class = EngineLoader  # how a state becomes the engine (a simulation swaps it)
    # Built by `setup`, each whole: a worker that has not joined has none.
    joined: Joined
    watch: Watch
    claims: Claims
    pacer: Pacer
    weights: Weights

    def __init__(self, cfg: WorkerConfig, store: ObjectStore | None = None):
        self.cfg = cfg
        self.private = None
        key_worker = None
        if cfg.key:
            key_worker, self.private = load_private(Path(cfg.key))
            if cfg.id and cfg.id != key_worker:
                raise ValueError(f"--id {cfg.id!r} but the key {cfg.key} is {key_worker!r}'s")
        self.id = keys.check_worker_id(
            cfg.id or key_worker or f"{socket.gethostname()}-{os.getpid()}"
        )
        self.engine_kind = resolve_engine(cfg.engine)  # before joining: fail fast
        # Before joining too: a --trust that names no key fails at once.
        self.trusted = trusted_fingerprint(cfg.trust) if cfg.trust else None
        self.store = store or open_store(
            cfg.store, endpoint_url=cfg.endpoint_url, profile=cfg.profile
        )
        self.stop = Stop()
        self.exporter = (
            Exporter(cfg.metrics_port, self.id, addr=cfg.metrics_host)
            if cfg.metrics_port is not None
            else None
        )
        self.tally = Tally()
        self.seq = 0
        self.batches = 0

    def setup(self) -> None:
        """Join the run: run.json (its key pinned), the inbox, the model's
        config and tokenizer; then the parts (`wire`)."""
        spec, trust = wait_for_run(
            self.store, self.cfg.join_timeout, self.cfg.poll_seconds, self.trusted
        )
        if self.trusted is None:
            log.warning(
                "no --trust: pinned the key that signed run.json, %s; pass --trust "
                "with the trainer's key or fingerprint to be sure",
                trust.fingerprint,
            )
            self.trusted = trust.fingerprint
        inbox = open_inbox(
            self.store,
            spec,
            endpoint_url=self.cfg.endpoint_url,
            profile=self.cfg.inbox_profile or self.cfg.profile,
        )
        telemetry = Telemetry.for_worker(inbox, self.id, 10.0, self.exporter)
        if spec.signed and self.private is None:
            raise ValueError(
                "this run takes only signed batches: make a key with `colonnade keys new`, "
                "have the operator register the .pub file, and pass --key"
            )
        env = load_environment(spec.env, **spec.env_kwargs)
        model, tok = self._fetch_model(spec)  # config and tokenizer only
        # Before any weights: an engine that cannot run this architecture says
        # so in one line (and `auto` picks one that can).
        self.engine_kind = resolve_engine(self.cfg.engine, model.config.model_type)
        aliases = tied_aliases(model)
        device = pick_device(self.cfg.device)
        s = dict(spec.sampling)
        s["stop"] = tuple(s.get("stop", ()))
        params = SamplingParams(**s)
        loader = self.loader_class(model, tok, spec.precision, device, self.engine_kind, aliases)
        self.wire(spec, trust, inbox, loader)
        tasks = list(env.tasks("train"))
        self.joined = Joined(spec, inbox, telemetry, env, tasks, params, time.time())

    def wire(self, spec: RunSpec, trust: Trust, inbox: ObjectStore, loader: EngineLoader) -> None:
        """The parts, over a run joined with `trust` (the end of `setup`)."""
        self.watch = Watch(self.store, trust, self.id, self.tally, self._stopping)
        self.claims = Claims(inbox, self.id, self.private, spec.run_id)
        self.pacer = Pacer(self.watch, self.tally, self._stopping, self.cfg.poll_seconds)
        self.weights = Weights(Follower(self.store, spec.anchor_every, trust), loader)

    def _stopping(self) -> bool:
        return self.stop.requested

    def _fetch_model(self, spec: RunSpec):
        """The model's config and tokenizer, as run.json hashes them: a file
        someone else replaced is waited past (the trainer puts its own back)."""
        t0 = time.monotonic()
        while True:
            try:
                return fetch_model(self.store, spec)
            except (ModelFileError, NotFound) as e:
                self.tally.unverified("a model file", e)
                if time.monotonic() - t0 > self.cfg.join_timeout:
                    raise TimeoutError(f"model files not as run.json says: {e}") from None
                time.sleep(self.cfg.poll_seconds)

    @property
    def running_version(self) -> int | None:
        """The version the engine generates with (None before the first)."""
        return self.weights.running_version

    # -- the loop ------------------------------------------------------------------------

    def run(self) -> int:
        """Loop until the run is done, a signal, or max_batches; the exit status."""
        self.stop.install()
        self.setup()
        beating = threading.Event()
        beat = threading.Thread(target=self._beating, args=(beating,), daemon=True)
        beat.start()
        try:
            self._loop()
        finally:
            beating.set()
            beat.join(timeout=30)
            try:
                self.weights.close()
            except (StoreError, VersionError) as e:  # a fetch nobody will use any more
                log.warning("the last background fetch failed: %s", e)
            if self.batches:
                try:
                    self.heartbeat()  # the last word: version and batches as they ended
                except StoreError as e:
                    log.warning("last heartbeat not written: %s", e)
            self.joined.telemetry.flush()
        log.info("worker %s: %d batches uploaded", self.id, self.batches)
        return 0

    def _loop(self) -> None:
        attempt = 0
        while not self.stop.requested:
            if self.cfg.max_batches and self.batches >= self.cfg.max_batches:
                break
            try:
                if self.watch.done():
                    log.info("the trainer finished the run")
                    break
                self.iteration()
                attempt = 0
            except (StoreError, VersionError) as e:
                # A version that vanished or does not verify may be a forgery
                # in a store others can write: the trainer puts its own back,
                # so the worker waits (backing off to 30 s), never exits.
                if isinstance(e, VersionError):
                    self.tally.unverified("a version", e)
                else:
                    self.tally.counts["store_errors"] += 1
                self.tally.counts["store_retries"] += 1
                backoff(log, "worker loop", min(attempt, 6), e)
                attempt += 1

    def iteration(self) -> None:
        """Sync, claim a slot (or wait for one), make and upload a batch, report."""
        self.sync()
        if self.running_version is None:
            time.sleep(self.cfg.poll_seconds)
            return
        if not self.claim():
            self.pacer.wait(self.running_version)
            return  # the next iteration syncs to what came
        t0 = time.perf_counter()
        batch = self.make_batch()
        key = self.upload(batch)
        self.batches += 1
        seconds = time.perf_counter() - t0
        # One look at latest.json per batch: the skew the batch landed with,
        # the demand for the next claim, and a newer version to fetch.
        self.watch.poll()
        log.info("uploaded %s (%d groups, %.1f s)", key, len(batch.groups), seconds)
        if self.batches == 1:  # the first batch says at once that the worker runs
            self.heartbeat()
        self.record(batch, seconds)

    def sync(self) -> None:
        """Bring the engine to the newest version latest.json named.

        A worker stalls only for loading the changed tensors into its engine
        (`load_seconds`): the apply (`apply_seconds`) ran beside generation.
        While a fetch is still running the engine generates on if the demand
        still has a slot for the version it runs; otherwise waiting costs
        nothing. The fetch reads no pointer of its own: the worker's one
        look at latest.json (after each upload, or while idle) starts it;
        the first version alone is fetched here, before any generation.
        """
        if self.weights.engine is None and (latest := self.watch.poll()) is not None:
            self.weights.fetch(latest)
        installed = self.weights.catch_up(self.watch.latest, self.free_slots)
        if installed is not None:
            self._installed(installed)

    def _installed(self, done: Installed) -> None:
        self.tally.synced(done.apply_seconds, done.load_seconds)
        self.watch.check_quarantine()
        self.pacer.installed(done.before, self.running_version)
        self.tally.counts["sync_bytes"] += self.weights.new_bytes()
        log.info(
            "now running v%d (was %s; apply %.2f s beside generation, load %.2f s)",
            self.running_version,
            done.before,
            done.apply_seconds,
            done.load_seconds,
        )

    def free_slots(self) -> list[int]:
        """Slots of the running version that the demand opens and this worker
        has not found taken."""
        return self.claims.free(self.watch.demand, self.running_version)

    def claim(self) -> bool:
        """Claim a slot of the running version: whether to make a batch now."""
        return self.claims.claim(self.watch.demand, self.running_version)

    def assignment(self) -> tuple[int, int, list[Task], list[bytes]]:
        """What the claim held decides (`protocol.draws`): (version, slot, its
        tasks in order, one draw key per episode, a group's rows together)."""
        j = self.joined
        v, slot = self.claims.held
        by_id = {t.id: t for t in j.tasks}
        ids = batch_tasks(j.spec.run_id, v, slot, list(by_id), j.spec.groups_per_batch)
        g = j.spec.group_size
        draws = [draw_key(j.spec.run_id, v, self.id, slot, i, row) for i in ids for row in range(g)]
        return v, slot, [by_id[i] for i in ids], draws

    def make_batch(self) -> RolloutBatch:
        j, engine = self.joined, self.weights.engine
        v, slot, chosen, draws = self.assignment()
        if v != engine.version:
            raise RuntimeError(f"claimed a slot of v{v} but the engine runs v{engine.version}")
        g = j.spec.group_size
        tasks = [t for t in chosen for _ in range(g)]
        results = run_episodes(engine, j.env, tasks, j.params, keys=draws, run_id=j.spec.run_id)
        groups = []
        for i, task in enumerate(chosen):
            eps = [r.episode for r in results[i * g : (i + 1) * g]]
            records = [EpisodeRecord(e.tokens, e.from_model, e.logprobs, e.finish, e.below)
                       for e in eps]  # fmt: skip
            for record, r in zip(records, results[i * g : (i + 1) * g], strict=True):
                record.tools = r.tools  # a tool service's signed replies
            # An environment the trainer cannot replay sends its rewards (train/trust.py).
            claimed = [r.score.reward for r in results[i * g : (i + 1) * g]]
            rewards = claimed if getattr(j.env, "worker_rewards", False) else None
            groups.append(GroupRecord(task.id, records, rewards))
        reward = sum(r.score.reward for r in results) / len(results)
        stats = {"reward_claimed": reward, **tool_figures(results)}
        self.tally.counts["tool_failures"] += sum(bool(r.tool_failed) for r in results)
        self.tally.counts["overflows"] += sum(r.episode.finish == "overflow" for r in results)
        return RolloutBatch(self.id, v, self.seq, groups, stats, engine.name, slot)

    def upload(self, batch: RolloutBatch) -> str:
        while True:
            batch.seq = self.seq
            key = keys.rollout_key(batch.version, self.id, self.seq)
            data = encode_batch(batch)
            if self.private is not None:
                data = sign(self.private, self.joined.spec.run_id, key, data)
            self.seq += 1
            if self.joined.inbox.put_if_absent(key, data):  # a restarted worker skips used seqs
                return key

    def _beating(self, done: threading.Event) -> None:
        """A heartbeat every HEARTBEAT_SECONDS once a version runs, until `done`."""
        while not done.wait(HEARTBEAT_SECONDS):
            if self.running_version is None:
                continue
            try:
                self.heartbeat()
            except StoreError as e:  # the next beat tries again
                log.warning("heartbeat not written: %s", e)

    def heartbeat(self) -> None:
        loader = self.weights.loader
        hb = WorkerHeartbeat(
            worker=self.id,
            host=socket.gethostname(),
            platform=platform.platform(),
            device=str(loader.device),
            engine=loader.label,
            threads=torch.get_num_threads(),
            version=self.running_version,
            batches=self.batches,
            bytes_synced=self.weights.follower.bytes_read,
            time=time.time(),
            started=self.joined.started,
        )
        self.joined.inbox.put(keys.heartbeat_key(self.id), hb.to_json())

    def record(self, batch: RolloutBatch, seconds: float) -> None:
        self.joined.telemetry.write(self.tally.row(batch, seconds, self.watch.newest))
