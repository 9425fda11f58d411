"""What rank 0 alone does around the training: the run's side of the store.

The trainer (train/trainer.py) keeps the weights and the loop on every
rank; rank 0 also holds a `Lead`, which it builds and calls:

    bind        the run's signer, inbox, publisher, telemetry, retention, planner
    open        the model files and run.json written or read back, the
                takeover check, then the collector (the ledgers of what was
                consumed, the counts so far, quarantine, the worker keys)
                and, with an exporter, the reader of the workers' metric rows
    each step   the worker keys read again, the trainer's documents guarded,
                groups collected, the ledger written, workers alive counted,
                quarantine judged, the heartbeat, a checkpoint every N versions
    background  the next version's demand and publication (its prepared state
                handed to the spot checks), retention, its row
    waiting     the demand worked out again, the documents checked
    end         trainer/done.json and the last latest.json

A step's store operations wait out an outage of up to
`store_outage_seconds` through `retried` (store/retry.py), which names
each one and the label the log gives it; everything else fails at once (at
start) or is best effort (while waiting for groups).

The lead never commands the other ranks: the checkpoint it waits on is the
trainer's (`checkpoint`, given at construction), which does.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from colonnade.config import TrainerConfig
from colonnade.envs import metrics_of
from colonnade.protocol import Publisher, RunSpec, keys, read_latest
from colonnade.protocol.documents import (
    ConsumedLedger,
    Done,
    Quarantine,
    TrainerHeartbeat,
    put_back,
    read_signed,
    sealed,
    write_signed,
)
from colonnade.protocol.inbox import list_inbox, open_inbox
from colonnade.protocol.metrics import TrainerRow
from colonnade.protocol.presence import fresh_workers
from colonnade.protocol.schemas import MAX_JSON_BYTES, Demand, SchemaError, batch_bytes_bound
from colonnade.protocol.signing import (
    Signer,
    fingerprint,
    keyring_json,
    load_keyring,
    read_run_envelope,
)
from colonnade.store import ObjectStore, StoreError
from colonnade.store.retry import Retrying
from colonnade.telemetry import Exporter, FleetReader, Telemetry

from .collect import Collected, Collector
from .demand import Planner, horizon, new_slots, wanted_groups
from .quarantine import Ledger, QuarantineConfig
from .retention import Retention

if TYPE_CHECKING:
    import torch

    from .spot import SpotChecker

log = logging.getLogger("colonnade.trainer")
# While waiting for groups, the demand is worked out again this often (a few
# LISTs): an expired claim or a refused batch opens new slots within a version.
REPLAN_SECONDS = 1.0


class RunConflict(RuntimeError):
    """The prefix holds a run this trainer must not take over."""


class Lead:
    """Rank 0's state beyond the weights (the run, its collector, quarantine,
    the documents it guards) and its store work."""

    def __init__(
        self,
        cfg: TrainerConfig,
        store: ObjectStore,
        private,
        instance: str,
        env,
        checkpoint: Callable[[int], None],
    ):
        log.info("trainer key %s", fingerprint(private.public_key()))
        self.cfg, self.store, self.private, self.instance = cfg, store, private, instance
        self.spec: RunSpec | None = None
        self.signer: Signer | None = None  # once the run's id is known
        self.collector: Collector | None = None
        self.spot: SpotChecker | None = None  # holds the published states it checks rows on
        self.quarantine = Ledger(
            QuarantineConfig(factor=cfg.quarantine_factor, min_tokens=cfg.quarantine_min_tokens)
        )
        self.exporter = None
        if cfg.metrics_port is not None:
            self.exporter = Exporter(
                cfg.metrics_port, "main", addr=cfg.metrics_host, env_metrics=metrics_of(env)
            )
        self.fleet: FleetReader | None = None  # the workers' rows, to the exporter
        self._replanned = 0.0  # when the demand was last worked out while waiting
        self._wait_began: float | None = None  # the step's first wait for groups
        # Documents workers act on, as last written here: put back if replaced.
        self.guarded: dict[str, bytes] = {}
        self.model_bytes: dict[str, bytes] = {}  # the model files, as published
        self._model_times: dict[str, float] | None = None  # their store times, once checked
        # The store operations a step waits on through an outage, each under
        # the name the log gives it.
        self.retried = Retrying(
            log,
            cfg.store_outage_seconds,
            keys=self.load_keys,
            guard=self.guard,
            collect=self._collect,
            ledger=self.write_ledger,
            workers=self.workers_alive,
            quarantine=self.write_quarantine,
            heartbeat=self.heartbeat,
            checkpoint=checkpoint,
            demand=self.plan,
            publish=self._publish_version,
            retention=self._sweep,
        )

    def bind(self, spec: RunSpec) -> Signer:
        """What needs the run: its id (signatures bind it) and its inbox; the
        run's signer."""
        cfg = self.cfg
        self.spec = spec
        self.signer = Signer(self.private, spec.run_id)
        self.inbox = open_inbox(
            self.store,
            spec,
            endpoint_url=cfg.inbox_endpoint_url or cfg.endpoint_url,
            profile=cfg.inbox_profile or cfg.profile,
        )
        self.publisher = Publisher(
            self.store, self.signer, cfg.precision, cfg.anchor_every, cfg.hash
        )
        self.publisher.keep_rest = cfg.lora_rank > 0  # snapshots of adapters alone
        self.telemetry = Telemetry.for_trainer(self.store, self.signer, 0.0, self.exporter)
        self.retention = Retention(
            self.store,
            self.inbox,
            cfg.max_lag,
            cfg.anchor_every,
            enabled=not cfg.retain_all,
            forget_workers_seconds=cfg.forget_workers_seconds,
        )
        self.planner = Planner(
            self.inbox,
            spec.run_id,
            cfg.groups_per_step,
            cfg.groups_per_batch,
            cfg.max_lag,
            cfg.max_versions,
            cfg.surplus_groups,
            cfg.claim_seconds,
        )
        return self.signer

    # -- start or resume -------------------------------------------------------------------
    def put_model(self, files: dict[str, bytes]) -> dict[str, bytes]:
        """A new run's model files, written and kept as published."""
        for name, data in files.items():
            self.store.put(keys.model_file(name), data)
        self.model_bytes = files
        return files

    def create_run(self) -> None:
        """run.json, written only if no other trainer wrote one meanwhile."""
        run = sealed(self.signer, keys.RUN, self.spec)
        if not self.store.put_if_absent(keys.RUN, run):
            raise RunConflict(f"another trainer created a run under {self.store.url} just now")
        self.guarded[keys.RUN] = run

    def read_run(self) -> tuple[RunSpec, bytes]:
        """The run under the prefix, as long as this trainer's key signed it."""
        data = self.store.get(keys.RUN, max_bytes=MAX_JSON_BYTES)
        mine = fingerprint(self.private.public_key())
        try:
            doc, _ = read_run_envelope(data, mine)
        except SchemaError as e:
            raise RunConflict(
                f"{keys.RUN} under {self.store.url} does not verify with this trainer's key "
                f"{mine} ({e}): resume with the run's key (--key), or start a new run "
                "under another prefix"
            ) from None
        return RunSpec.from_dict(doc), data

    def adopt_run(self, run: bytes, files: dict[str, bytes]) -> None:
        """A resumed run's run.json and model files, guarded from now on."""
        self.guarded[keys.RUN] = run
        self.model_bytes = {n: files[n] for n in self.spec.model_files if n in files}

    def check_takeover(self) -> None:
        """Refuse a run whose trainer's heartbeat is fresh, unless told to take over."""
        try:
            hb = read_signed(self.store, keys.HEARTBEAT, TrainerHeartbeat, self.signer.trust)
        except SchemaError as e:  # not this trainer's: anyone may have written it
            log.warning("%s is not this trainer's (%s): ignored", keys.HEARTBEAT, e)
            return
        if hb is None:
            return
        age = time.time() - hb.time
        if age < self.cfg.heartbeat_timeout and not self.cfg.takeover:
            raise RunConflict(
                f"another trainer ({hb.host}, {hb.instance}) wrote a heartbeat "
                f"{age:.0f} s ago under {self.store.url}; if it is dead, pass --takeover"
            )

    def start_collecting(
        self,
        rebuild: Callable,
        check_draws: Callable | None = None,
        spot: SpotChecker | None = None,
    ) -> None:
        """The collector, with what this run consumed and decided so far;
        `rebuild(group, version)` replays a group into samples,
        `check_draws(batch)` says why a batch's randomness is not the run's,
        and `spot` recomputes some rows on the published states this lead
        hands it (from the newest one on)."""
        cfg, spec = self.cfg, self.spec
        consumed, seen = self._consumed()
        max_tokens = cfg.max_episode_tokens + cfg.max_turn_tokens
        self.collector = Collector(
            self.inbox,
            spec.run_id,
            rebuild,
            vocab=spec.vocab_size,
            max_tokens=max_tokens,
            max_lag=cfg.max_lag,
            poll_seconds=cfg.poll_seconds,
            consumed=consumed,
            seen=seen,
            max_raw=batch_bytes_bound(
                spec.groups_per_batch * spec.group_size, max_tokens, spec.groups_per_batch
            ),
            check_draws=check_draws,
            spot=spot,
        )
        self.spot = spot
        if spot is not None and self.publisher.last is not None:
            spot.add(self.publisher.version, self.publisher.last)
        self._restore_counts()
        self.quarantine.decisions = self._read_quarantine()
        self.collector.quarantined = set(self.quarantine.decisions)
        self.publisher.quarantined = len(self.quarantine.decisions)
        self.load_keys()
        if self.exporter is not None:  # once the registered ids are known
            self.fleet = FleetReader(self.exporter, self.inbox, self.registered).start()

    def announce_resumed(self, version: int) -> None:
        """Resumed: the demand from what the store holds, as if after a step."""
        try:
            latest = read_latest(self.store, self.signer.trust)
        except SchemaError:
            latest = None
        current = latest.demand if latest is not None else None
        self.publisher.announce(self.plan(version, version, current))

    def _consumed(self) -> tuple[set[str], set[str]]:
        """(keys, group content digests) of every batch a trainer of this run took,
        trained on or rejected."""
        taken: set[str] = set()
        seen: set[str] = set()
        for key in self.store.list(keys.CONSUMED):
            if keys.parse_consumed_key(key) is None:
                continue
            try:
                ledger = read_signed(self.store, key, ConsumedLedger, self.signer.trust)
            except SchemaError as e:
                log.warning(
                    "ledger %s is not this trainer's (%s): ignored (delete it to silence this)",
                    key,
                    e,
                )
                continue
            if ledger is not None:
                taken.update(ledger.keys, ledger.rejected)
                seen.update(ledger.digests)
        return taken, seen

    def _restore_counts(self) -> None:
        """Resumed: the collector's counters go on from the last row written,
        so totals (rejections by reason, drops) cover the whole run."""
        try:
            last = TrainerRow.from_dict(self.telemetry.last or {"time": 0.0, "version": 0})
        except SchemaError as e:
            log.warning("the last metric row does not read (%s): counts start at 0", e)
            return
        self.collector.counts.update(last.counts)
        for w, c in last.per_worker.items():
            self.collector.per_worker[w] = Counter(c)

    def _read_quarantine(self) -> dict:
        try:
            found = read_signed(self.store, keys.QUARANTINE, Quarantine, self.signer.trust)
        except SchemaError as e:
            log.warning(
                "%s is not this trainer's (%s): no worker is quarantined; it is "
                "written again at the next decision",
                keys.QUARANTINE,
                e,
            )
            return {}
        if found is not None:
            self.guarded[keys.QUARANTINE] = sealed(self.signer, keys.QUARANTINE, found)
        return dict(found.decisions) if found is not None else {}

    # -- the documents ---------------------------------------------------------------------
    def load_keys(self) -> None:
        """Re-read the registered public keys and publish them (trainer/keys.json)."""
        if not self.cfg.worker_keys:
            return
        ring = load_keyring(Path(self.cfg.worker_keys))
        if ring.keys() != (self.collector.keyring or {}).keys():
            self.store.put(keys.KEYRING, self.signer.seal(keys.KEYRING, keyring_json(ring)))
            log.info("registered worker keys: %s", ", ".join(sorted(ring)))
        self.collector.keyring = ring

    def guard(self) -> int:
        """run.json, latest.json and quarantine.json as this trainer wrote
        them: anyone who can write the run's store could replace or delete
        them (workers would ignore the forgery, but lose sight of the run), so
        they are checked and put back; how many had to be."""
        fixed = int(self.publisher.guard()) + self._guard_model()
        fixed += sum(put_back(self.store, key, mine) for key, mine in self.guarded.items())
        if fixed:
            log.warning(
                "%d of the trainer's documents were replaced by someone else: written again", fixed
            )
        return fixed

    def _guard_model(self) -> int:
        """The model files as published: one listing while their store times
        hold; read and hashed again (and put back) when one changed."""
        times = self.store.list_times(keys.MODEL)
        if times == self._model_times:
            return 0
        fixed = sum(
            put_back(self.store, keys.model_file(name), data)
            for name, data in self.model_bytes.items()
        )
        self._model_times = self.store.list_times(keys.MODEL)
        return fixed

    def heartbeat(self, version: int | None) -> None:
        hb = TrainerHeartbeat(self.instance, socket.gethostname(), time.time(), version)
        write_signed(self.store, keys.HEARTBEAT, hb, self.signer)

    def write_quarantine(self) -> None:
        doc = sealed(self.signer, keys.QUARANTINE, Quarantine(dict(self.quarantine.decisions)))
        self.store.put(keys.QUARANTINE, doc)
        self.guarded[keys.QUARANTINE] = doc

    def write_ledger(self, new_v: int, got: Collected) -> None:
        """The batches that trained `new_v`, recorded before it is published."""
        ledger = ConsumedLedger(sorted(got.keys), sorted(got.rejected), sorted(got.digests))
        write_signed(self.store, keys.consumed_key(new_v, self.instance), ledger, self.signer)

    def finish(self, version: int) -> None:
        """trainer/done.json, then the latest.json workers poll, marked done."""
        write_signed(self.store, keys.DONE, Done(version, time.time()), self.signer)
        self.publisher.point(done=True)
        if self.spot is not None:
            log.info(
                "spot checks: %d rows recomputed in %.1f s (%.1f s of it loading versions)",
                self.spot.rows_checked,
                self.spot.seconds,
                self.spot.load_seconds,
            )

    # -- each step -------------------------------------------------------------------------
    def collect(self, v: int, need: int, stop: Callable[[int], bool]) -> Collected:
        """The groups for the step at v, waiting out outages; `stop(taken)`
        is polled while waiting for them."""
        self._wait_began = None
        return self.retried.collect(v, need, stop)

    def _collect(self, v: int, need: int, stop: Callable[[int], bool]) -> Collected:
        return self.collector.collect(v, need, stop=stop)

    def registered(self) -> set[str] | None:
        ring = self.collector.keyring
        return set(ring) if ring is not None else None

    def workers_alive(self) -> int:
        """Workers whose heartbeat is younger than heartbeat_timeout (registered
        ones only, in a signed run)."""
        listing = list_inbox(self.inbox, self.registered())
        return len(fresh_workers(listing, time.time(), self.cfg.heartbeat_timeout))

    def judge(self, version: int, gate_by_version) -> None:
        """Quarantine after the update that made `version`: a new decision is
        written (waiting out outages) and announced by the next latest.json,
        written after quarantine.json."""
        forged, self.collector.forged = self.collector.forged, {}
        convicted = [self.quarantine.convict(w, proof, version) for w, proof in forged.items()]
        judged = self.quarantine.judge(version, gate_by_version)
        if not (any(convicted) or judged):
            return
        self.collector.quarantined = set(self.quarantine.decisions)
        self.retried.quarantine()
        self.publisher.quarantined = len(self.quarantine.decisions)

    # -- the demand ------------------------------------------------------------------------
    def plan(
        self,
        step: int,
        target: int,
        current: Demand | None = None,
        consumed: set[str] | None = None,
        taken: int = 0,
        current_step_only: bool = False,
    ) -> Demand:
        """The demand for slots of version `target`, seen from the step at `step`."""
        c = self.collector
        return self.planner.plan(
            step,
            target,
            c.consumed if consumed is None else consumed,
            set(c.quarantined),
            taken,
            current,
            current_step_only,
            keyring=c.keyring,
        )

    def first_demand(self) -> Demand:
        """v0's demand: nothing made or claimed yet."""
        cfg = self.cfg
        want = wanted_groups(
            horizon(0, cfg.max_versions, cfg.groups_per_step, cfg.max_lag),
            0,
            cfg.surplus_groups,
            0,
            0,
        )
        return Demand(0, new_slots(0, want, cfg.groups_per_batch), 0, cfg.claim_seconds)

    def waiting(self, v: int, taken: int) -> None:
        """Polled while collecting for the step at v, `taken` groups so far:
        the demand kept current and the documents checked (best effort)."""
        now = time.monotonic()
        if self._wait_began is None:
            self._wait_began = now
        elif min(now - self._wait_began, now - self._replanned) > REPLAN_SECONDS:
            self._replan(v, taken)
            try:
                self.guard()
            except StoreError as e:
                log.warning("documents not checked: %s", e)

    def _replan(self, v: int, taken: int) -> None:
        """While waiting: the demand again, for the newest published version
        and the shortfall of this step (best effort: the next poll tries
        again after a store error)."""
        self._replanned = time.monotonic()
        target, current = self.publisher.version, self.publisher.demand
        if target is None:
            return
        try:
            demand = self.plan(v, target, current, taken=taken, current_step_only=True)
            if self.publisher.announce(demand) and current is not None:
                log.info("demand for v%d: %d slots (was %d)", target, demand.slots, current.slots)
        except StoreError as e:
            log.warning("demand not updated: %s", e)

    # -- the background publication --------------------------------------------------------
    def publish(self, state: dict[str, torch.Tensor], row: TrainerRow, consumed: set[str]) -> None:
        """Background: publish the snapshot as the next version with its
        demand, then its metrics row."""
        v = row.version
        retried = self.retried
        demand = retried.demand(v, v, consumed=consumed)
        pub = retried.publish(state, demand)
        if self.spot is not None:
            self.spot.add(pub.meta.version, self.publisher.last)
        m = replace(
            row,
            deleted=retried.retention(pub.meta.version),
            publish_seconds=round(pub.seconds, 3),
            patch_bytes=pub.meta.patch_bytes,
            anchor_bytes=pub.meta.anchor_bytes,
            full_bytes=pub.meta.full_bytes,
            kind=pub.meta.kind,
        )
        self.telemetry.write(m)
        log.info(
            "v%d loss %.4f reward %.3f pass %.2f masked %.4f kl %.4f tokens %d "
            "wait %.1fs patch %d B (%.2f%% of full) publish %.2fs blocked %.2fs",
            m.version,
            m.loss,
            m.reward_mean,
            m.pass_rate,
            m.masked_fraction,
            m.mismatch_kl,
            m.tokens,
            m.wait_seconds,
            m.patch_bytes,
            100 * m.patch_bytes / max(1, m.full_bytes),
            m.publish_seconds,
            m.publish_blocked_seconds,
        )

    def _publish_version(self, state: dict[str, torch.Tensor], demand: Demand):
        return self.publisher.publish(state, demand)

    def _sweep(self, version: int) -> int:
        return self.retention.sweep(version, self.registered())
