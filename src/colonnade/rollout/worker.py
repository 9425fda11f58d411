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
"""

from __future__ import annotations

import logging
import os
import platform
import random
import signal
import socket
import time
from pathlib import Path

import torch

from colonnade.background import Background
from colonnade.config import WorkerConfig
from colonnade.engine import Engine, SamplingParams, engine_for, refresh, resolve_engine
from colonnade.envs import load_environment
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
    read_latest,
)
from colonnade.protocol.documents import (
    Claim,
    Done,
    Quarantine,
    WorkerHeartbeat,
    open_claim,
    read_signed,
    seal_claim,
)
from colonnade.protocol.inbox import open_inbox
from colonnade.protocol.metrics import WorkerRow
from colonnade.protocol.model_files import ModelFileError, fetch_model
from colonnade.protocol.polling import idle_delay, moving_gap
from colonnade.protocol.schemas import MAX_JSON_BYTES, Latest, ProtocolMismatch, SchemaError
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

from .episodes import run_episodes

log = logging.getLogger("colonnade.worker")
# A heartbeat at most this often (and with the first batch): the trainer
# counts workers alive over `heartbeat_timeout` (60 s).
HEARTBEAT_SECONDS = 20.0
# Slots tried per look at the demand, after a listing of the taken ones:
# workers that look at once may still collide, and each try is a billed request.
CLAIM_TRIES = 2
NAP_SECONDS = 0.5  # an idle wait sleeps in pieces this long, so a stop is seen
UNVERIFIED_RETRIES = 8  # quick looks again at a latest.json that does not verify
HINT_SECONDS = 600.0  # the most a joiner believes of latest.json's version_seconds


class Quarantined(RuntimeError):
    """The trainer refuses this worker's batches (trainer/quarantine.json)."""


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


class Worker:
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
        self.inbox: ObjectStore | None = None  # where this worker writes, from run.json
        self.stop = Stop()
        self.seq = 0
        self.batches = 0
        self.exporter = (
            Exporter(cfg.metrics_port, self.id) if cfg.metrics_port is not None else None
        )
        self.telemetry: Telemetry | None = None
        self.pending = {"sync_bytes": 0, "store_errors": 0, "store_retries": 0, "unverified": 0}
        self._unverified_said: set[str] = set()  # kinds of document logged once
        # sync = apply (download, patch, hash) + load (the changed tensors into the engine)
        self.pending_time = {
            "sync_seconds": 0.0,
            "apply_seconds": 0.0,
            "load_seconds": 0.0,
            "paced_seconds": 0.0,
        }
        self.refused: set[str] = set()  # quarantined workers, read at each new version
        self.version_gap: float | None = None  # seconds between versions (moving average)
        self._synced_at = 0.0
        self.engine: Engine | None = None  # built once the first version's weights load
        self.prefetch = Background("fetch")  # the follower's next sync, while generating
        self._fetched: float | None = None  # seconds the last fetch took, until installed
        # The state objects the engine last loaded: a tensor a patch rewrote
        # is a new object, so the keys to load again are those whose object
        # differs from the engine's (whatever the follower went through since,
        # a fetch that failed half-way included).
        self._loaded: dict[str, torch.Tensor] = {}
        self._bytes_counted = 0
        self.pointer: Latest | None = None  # the last latest.json read: version, demand, done
        self.finished = False  # trainer/done.json seen (where latest.json did not verify)
        self.taken: tuple[int | None, set[int]] = (None, set())  # (version, slots found taken)
        self.claims = 0  # slots claimed by this process
        # Claims whose put failed (an outage): it may have landed all the same,
        # so a retry that finds the slot taken reads whose it is.
        self.unsure: set[str] = set()
        self._quarantined_seen = 0
        self._beat = 0.0  # when the last heartbeat went up

    def setup(self) -> None:
        self.spec, self.trust = wait_for_run(
            self.store, self.cfg.join_timeout, self.cfg.poll_seconds, self.trusted
        )
        if self.trusted is None:
            log.warning(
                "no --trust: pinned the key that signed run.json, %s; pass --trust "
                "with the trainer's key or fingerprint to be sure",
                self.trust.fingerprint,
            )
            self.trusted = self.trust.fingerprint
        self.inbox = open_inbox(
            self.store,
            self.spec,
            endpoint_url=self.cfg.endpoint_url,
            profile=self.cfg.inbox_profile or self.cfg.profile,
        )
        self.telemetry = Telemetry.for_worker(self.inbox, self.id, 10.0, self.exporter)
        if self.spec.signed and self.private is None:
            raise ValueError(
                "this run takes only signed batches: make a key with `colonnade keys new`, "
                "have the operator register the .pub file, and pass --key"
            )
        self.env = load_environment(self.spec.env, **self.spec.env_kwargs)
        model, self.tok = self._fetch_model()  # config and tokenizer only
        # Before any weights: an engine that cannot run this architecture says
        # so in one line (and `auto` picks one that can).
        self.engine_kind = resolve_engine(self.cfg.engine, model.config.model_type)
        self.aliases = tied_aliases(model)
        self.device = pick_device(self.cfg.device)
        self.model = model
        s = dict(self.spec.sampling)
        s["stop"] = tuple(s.get("stop", ()))
        self.params = SamplingParams(**s)
        self.follower = Follower(self.store, self.spec.anchor_every, self.trust)
        self.tasks = list(self.env.tasks("train"))
        self.started = time.time()

    def _fetch_model(self):
        """The model's config and tokenizer, as run.json hashes them: a file
        someone else replaced is waited past (the trainer puts its own back)."""
        t0 = time.monotonic()
        while True:
            try:
                return fetch_model(self.store, self.spec)
            except (ModelFileError, NotFound) as e:
                self.unverified("a model file", e)
                if time.monotonic() - t0 > self.cfg.join_timeout:
                    raise TimeoutError(f"model files not as run.json says: {e}") from None
                time.sleep(self.cfg.poll_seconds)

    def _load_weights(self) -> None:
        """The follower's state into the engine: the first time built, then
        in place, only the tensors that are not the objects it loaded last."""
        state, version = self.follower.state, self.follower.version
        if self.engine is None:
            self.engine = engine_for(
                self.model,
                self.tok,
                state,
                self.spec.precision,
                self.device,
                self.engine_kind,
                version,
                self.aliases,
            )
        else:
            changed = {k for k, t in state.items() if self._loaded.get(k) is not t}
            refresh(self.engine, state, changed, version)
        self._loaded = dict(state)

    def engine_label(self) -> str:
        if self.engine_kind == "mlx":
            return f"mlx-{self.spec.precision}"
        return f"{self.spec.precision}-{'w8' if self.device.type == 'cpu' else 'float'}"

    @property
    def running_version(self) -> int | None:
        """The version the engine generates with (None before the first)."""
        return self.engine.version if self.engine is not None else self.follower.version

    def unverified(self, kind: str, error: Exception) -> None:
        """A document that the trainer did not sign: counted, logged once per kind."""
        self.pending["unverified"] += 1
        if kind not in self._unverified_said:
            self._unverified_said.add(kind)
            log.warning("ignored %s: not signed by the trainer's key (%s)", kind, error)

    def _poll(self):
        """weights/latest.json: the one request a waiting worker makes. One
        that does not verify, or names an older version than one seen, is
        ignored (None)."""
        for attempt in range(UNVERIFIED_RETRIES + 1):
            try:
                latest = read_latest(self.store, self.trust)
                break
            except SchemaError as e:
                # Someone replaced it; the trainer puts its own back within
                # about a second: a few quick looks usually find it.
                if attempt == UNVERIFIED_RETRIES or self.stop.requested:
                    self.unverified("latest.json", e)  # once a look
                    self._check_done()
                    return None
                time.sleep(random.uniform(0.1, 0.4))
        if latest is None:
            self._check_done()
            return None
        if self.pointer is not None and latest.version < self.pointer.version:
            return None  # an old pointer put back: versions never go backwards
        self.pointer = latest
        return latest

    def _fetch(self, latest: Latest) -> None:
        """Move the follower to `latest`'s version: download, patch, hash check.
        Runs in the background (but for the first version) while the engine
        generates with the weights it holds; PULSE leaves the tensors it did
        not rewrite as they were (the same objects), so identity tells which
        ones the engine must load (`_load_weights`)."""
        t0 = time.perf_counter()
        if self.follower.sync(latest.version, known=latest.meta):
            self._fetched = time.perf_counter() - t0

    def sync(self) -> None:
        """Bring the engine to the newest version latest.json named.

        A worker stalls only for loading the changed tensors into its engine
        (`load_seconds`): the apply (`apply_seconds`) ran beside generation.
        While a fetch is still running the engine generates on if the demand
        still has a slot for the version it runs; otherwise waiting costs
        nothing. The fetch reads no pointer of its own: the worker's one
        look at latest.json (after each upload, or while idle) starts it.
        """
        if self.engine is None:
            latest = self._poll()
            if latest is not None:
                self._fetch(latest)
        p = self.pointer
        behind = (
            p is not None
            and self.follower.version is not None
            and (p.version > self.follower.version)
        )
        if behind and not self.prefetch.busy and self._fetched is None:
            self.prefetch.submit(lambda: self._fetch(p))
        if self.prefetch.busy and self.free_slots():
            return
        self.prefetch.wait()  # raises what the fetch raised
        fetched, self._fetched = self._fetched, None
        if fetched is not None:
            self._install(fetched)

    def _install(self, apply_seconds: float) -> None:
        before = self.running_version
        t0 = time.perf_counter()
        self._load_weights()
        load = time.perf_counter() - t0
        self.pending_time["apply_seconds"] += apply_seconds
        self.pending_time["load_seconds"] += load
        self.pending_time["sync_seconds"] += apply_seconds + load
        if self.pointer is not None and self.pointer.quarantined > self._quarantined_seen:
            self.refused = self.read_quarantine()
            self._quarantined_seen = self.pointer.quarantined
        now = time.monotonic()
        if before is not None and self.running_version == before + 1:
            self.version_gap = moving_gap(self.version_gap, now - self._synced_at)
        self._synced_at = now
        read = self.follower.bytes_read
        self.pending["sync_bytes"] += read - self._bytes_counted
        self._bytes_counted = read
        log.info(
            "now running v%d (was %s; apply %.2f s beside generation, load %.2f s)",
            self.running_version,
            before,
            apply_seconds,
            load,
        )

    def make_batch(self) -> RolloutBatch:
        v = self.engine.version
        rng = random.Random(f"{self.cfg.seed}/{self.id}/{v}/{self.seq}")
        chosen = rng.sample(self.tasks, min(self.spec.groups_per_batch, len(self.tasks)))
        g = self.spec.group_size
        results = run_episodes(
            self.engine,
            self.env,
            [t for t in chosen for _ in range(g)],
            self.params,
            seed=rng.randrange(1 << 31),
        )
        groups = []
        for i, task in enumerate(chosen):
            eps = [r.episode for r in results[i * g : (i + 1) * g]]
            groups.append(
                GroupRecord(
                    task.id,
                    [EpisodeRecord(e.tokens, e.from_model, e.logprobs, e.finish) for e in eps],
                )
            )
        reward = sum(r.score.reward for r in results) / len(results)
        stats = {"reward_claimed": reward}
        return RolloutBatch(self.id, v, self.seq, groups, stats, engine=self.engine.name)

    def upload(self, batch: RolloutBatch) -> str:
        while True:
            batch.seq = self.seq
            key = keys.rollout_key(batch.version, self.id, self.seq)
            data = encode_batch(batch)
            if self.private is not None:
                data = sign(self.private, self.spec.run_id, key, data)
            self.seq += 1
            if self.inbox.put_if_absent(key, data):  # a restarted worker skips used seqs
                return key

    def heartbeat(self) -> None:
        hb = WorkerHeartbeat(
            worker=self.id,
            host=socket.gethostname(),
            platform=platform.platform(),
            device=str(self.device),
            engine=self.engine_label(),
            threads=torch.get_num_threads(),
            version=self.running_version,
            batches=self.batches,
            bytes_synced=self.follower.bytes_read,
            time=time.time(),
            started=self.started,
        )
        self.inbox.put(keys.heartbeat_key(self.id), hb.to_json())
        self._beat = time.monotonic()

    def _check_done(self) -> None:
        """latest.json is missing or not the trainer's: trainer/done.json then
        says whether the run is over (once the trainer has exited, nobody puts
        its latest.json back)."""
        try:
            self.finished = read_signed(self.store, keys.DONE, Done, self.trust) is not None
        except SchemaError as e:
            self.unverified("done.json", e)

    def done(self) -> bool:
        """The run is over: latest.json says so (polled with each fetch), or,
        where latest.json does not verify, the trainer's done.json."""
        return self.finished or (self.pointer is not None and self.pointer.done)

    def read_quarantine(self) -> set[str]:
        """The workers the trainer refuses; raises Quarantined if this is one."""
        try:
            found = read_signed(self.store, keys.QUARANTINE, Quarantine, self.trust)
        except SchemaError as e:
            self.unverified("quarantine.json", e)
            return self.refused
        decisions = found.decisions if found is not None else {}
        if self.id in decisions:
            raise Quarantined(
                f"the trainer quarantined worker {self.id} ({decisions[self.id].reason}) and "
                "refuses its batches; check its weights and engine, then rejoin under a new id"
            )
        return set(decisions)

    def free_slots(self) -> list[int]:
        """Slots of the running version that the demand opens and this worker
        has not found taken (none when the demand is for another version)."""
        d = self.pointer.demand if self.pointer is not None else None
        v = self.running_version
        if d is None or v is None or d.version != v:
            return []
        if self.taken[0] != v:
            self.taken = (v, set())
        return [s for s in range(d.slots) if s not in self.taken[1]]

    def claim(self) -> bool:
        """Claim a slot of the running version (put-if-absent; the first
        writer has it): whether this worker is to make a batch now. One
        listing of the version's claims tells which slots are taken (a slot
        someone else holds, a ghost's included, is never tried blind: a
        worker that tried taken slots and waited for the demand to change
        would wait for ever where the trainer counted an untried slot as
        promised); then a few random free slots are tried, so that many
        workers seldom collide."""
        free = self.free_slots()
        v = self.running_version
        if not free:
            return False
        for key in self.inbox.list(keys.claims_dir(v)):
            found = keys.parse_claim_key(key)
            if found is not None and found[0] == v and key not in self.unsure:
                self.taken[1].add(found[1])
        free = [s for s in free if s not in self.taken[1]]
        for slot in random.sample(free, min(CLAIM_TRIES, len(free))):
            key = keys.claim_key(v, slot)
            claim = seal_claim(self.private, self.spec.run_id, key, Claim(self.id, time.time()))
            try:
                won = self.inbox.put_if_absent(key, claim)
            except StoreError:
                # Not marked taken: the slot stays this worker's to try again
                # once the store answers (marking it would leave a worker that
                # saw an outage with no free slot and a demand that never changes).
                self.unsure.add(key)
                raise
            self.taken[1].add(slot)  # ours or another's: not free either way
            if won or (key in self.unsure and self._mine(key)):
                self.unsure.discard(key)
                self.claims += 1
                return True
        return False

    def _mine(self, key: str) -> bool:
        """Whether the claim at `key` is this worker's (a put that failed but landed)."""
        try:
            found = open_claim(
                self.inbox.get(key, max_bytes=Claim.MAX_BYTES), key, self.spec.run_id, None
            )
        except (NotFound, SchemaError):
            return False
        return found.worker == self.id

    def wait_for_work(self) -> None:
        """Nothing to make: wait until latest.json changes (a new version, new
        slots, the run's end) or a stop, looking at it at the pace of the
        versions (`idle_delay`); the time is counted as `paced_seconds`."""
        seen, t0, polls = self.pointer, time.monotonic(), 0
        try:
            while not self.stop.requested:
                delay = idle_delay(self.pace(), self._since_version(), polls, self.cfg.poll_seconds)
                self._nap(delay)
                if self.stop.requested:
                    return
                latest = self._poll()
                polls += 1
                if self.finished:
                    return
                if latest is not None and (
                    seen is None
                    or latest.done
                    or latest.version != seen.version
                    or latest.demand != seen.demand
                ):
                    return
        finally:
            self.pending_time["paced_seconds"] += time.monotonic() - t0

    def pace(self) -> float | None:
        """Seconds between versions: measured here once two versions came in
        a row, before that the trainer's own figure from latest.json (at most
        HINT_SECONDS: a worker that has measured nothing does not sleep long
        on another's word)."""
        if self.version_gap is not None:
            return self.version_gap
        hint = self.pointer.version_seconds if self.pointer is not None else None
        return None if hint is None else min(hint, HINT_SECONDS)

    def _since_version(self) -> float:
        """Seconds since the running version came: since this worker installed
        it, or, while it paces by the trainer's figure (it has just joined),
        since the trainer published it, if longer (clocks a few seconds apart
        only shorten the wait)."""
        local = time.monotonic() - self._synced_at
        p = self.pointer
        if self.version_gap is not None or p is None or p.version != self.running_version:
            return local
        return max(local, time.time() - p.meta.created)

    def _nap(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stop.requested and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, NAP_SECONDS))

    def iteration(self) -> None:
        self.sync()
        if self.running_version is None:
            time.sleep(self.cfg.poll_seconds)
            return
        if not self.claim():
            self.wait_for_work()
            return  # the next iteration syncs to what came
        t0 = time.perf_counter()
        batch = self.make_batch()
        key = self.upload(batch)
        self.batches += 1
        seconds = time.perf_counter() - t0
        # One look at latest.json per batch: the skew the batch landed with,
        # the demand for the next claim, and a newer version to fetch.
        self._poll()
        log.info("uploaded %s (%d groups, %.1f s)", key, len(batch.groups), seconds)
        if time.monotonic() - self._beat >= HEARTBEAT_SECONDS or self.batches == 1:
            self.heartbeat()
        self.record(batch, seconds)

    def record(self, batch: RolloutBatch, seconds: float) -> None:
        newest = self.pointer.version if self.pointer is not None else None
        eps = [e for g in batch.groups for e in g.episodes]
        row = WorkerRow(
            time=time.time(),
            version=batch.version,
            version_skew=(newest or batch.version) - batch.version,
            episodes=len(eps),
            tokens=sum(sum(e.from_model) for e in eps),
            seconds=round(seconds, 3),
            reward_mean=batch.stats.get("reward_claimed", 0.0),
            **self.pending,
            **{k: round(v, 3) for k, v in self.pending_time.items()},
        )
        self.telemetry.write(row)
        self.pending = dict.fromkeys(self.pending, 0)
        self.pending_time = dict.fromkeys(self.pending_time, 0.0)

    def run(self) -> int:
        """Loop until the run is done, a signal, or max_batches; the exit status."""
        self.stop.install()
        self.setup()
        try:
            self._loop()
        finally:
            try:
                self.prefetch.close()
            except (StoreError, VersionError) as e:  # a fetch nobody will use any more
                log.warning("the last background fetch failed: %s", e)
            if self.batches:
                try:
                    self.heartbeat()  # the last word: version and batches as they ended
                except StoreError as e:
                    log.warning("last heartbeat not written: %s", e)
            if self.telemetry is not None:
                self.telemetry.flush()
        log.info("worker %s: %d batches uploaded", self.id, self.batches)
        return 0

    def _loop(self) -> None:
        attempt = 0
        while not self.stop.requested:
            if self.cfg.max_batches and self.batches >= self.cfg.max_batches:
                break
            try:
                if self.done():
                    log.info("the trainer finished the run")
                    break
                self.iteration()
                attempt = 0
            except (StoreError, VersionError) as e:
                # A version that vanished or does not verify may be a forgery
                # in a store others can write: the trainer puts its own back,
                # so the worker waits (backing off to 30 s), never exits.
                if isinstance(e, VersionError):
                    self.unverified("a version", e)
                else:
                    self.pending["store_errors"] += 1
                self.pending["store_retries"] += 1
                backoff(log, "worker loop", min(attempt, 6), e)
                attempt += 1
