"""The trainer: updates the weights and publishes versions; one process, or
several ranks under torchrun with FSDP2 (`distributed`).

    start:  run.json (put-if-absent), model files, checkpoint v0, publish v0
    loop:   collect groups (v − max_lag … v) → recompute rewards → DPPO step
            → record consumed batches (ledger) → snapshot → publish v+1 in
            the background (patch; anchor every K; latest.json with the
            demand: claim slots of v+1, `demand`) while the next step runs
            → metrics, heartbeat; checkpoint every N versions
    end:    trainer/done.json, which tells workers to stop

Everything the trainer writes for workers is signed with its key (`--key`,
or one kept in the local cache); workers write only to the inbox, which the
trainer reads as hostile (train/collect.py, train/demand.py) and keeps
bounded (train/retention.py). Between steps and while waiting it checks
that run.json, latest.json and quarantine.json are still what it wrote,
and writes them again if anyone replaced them (`_guard`).

Rank 0 leads (store, rollouts, versions, metrics); the other ranks hold
their shards and follow its commands (`follow`).

Resuming loads the newest checkpoint and continues after the newest
*published* version: version numbers are never skipped or reused, and
batches recorded as consumed are never used again (updates made after the
checkpoint are lost; their batches stay consumed). A checkpoint of a version
whose publication was cut short is published first.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import time
import uuid
from collections import Counter
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch

from colonnade.background import Background
from colonnade.config import TrainerConfig
from colonnade.envs import load_environment, metrics_of, success_of, tokenizer_texts_of
from colonnade.model import cache_root, load_model, local_model_dir, resolve_model, tied_aliases
from colonnade.model.device import peak_memory_mb
from colonnade.protocol import Follower, Publisher, RunSpec, keys, latest_version, read_latest
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
from colonnade.protocol.model_files import model_files
from colonnade.protocol.polling import moving_gap
from colonnade.protocol.presence import fresh_workers
from colonnade.protocol.schemas import MAX_JSON_BYTES, Demand, SchemaError, batch_bytes_bound
from colonnade.protocol.signing import (
    Signer,
    fingerprint,
    keyring_json,
    load_keyring,
    load_private,
    public_hex,
    read_run_envelope,
    write_private,
)
from colonnade.protocol.turns import episode_stops, run_sampling
from colonnade.protocol.weights import VersionError
from colonnade.pulse.hashing import digest_bytes
from colonnade.store import ObjectStore, StoreError, open_store
from colonnade.store.retry import retry_unavailable
from colonnade.telemetry import Exporter, Telemetry

from .checkpoint import Checkpointer, latest_checkpoint, prune_checkpoints
from .collect import Collector
from .demand import Planner, horizon, new_slots, wanted_groups
from .distributed import Command, Dist, init_distributed
from .loss import GateConfig
from .policy import build_policy, full_state
from .quarantine import Ledger, QuarantineConfig
from .retention import Retention
from .samples import rebuild_group
from .step import StepConfig, StepFigures, train_step

log = logging.getLogger("colonnade.trainer")
PING_SECONDS = 20.0  # rank 0 tells waiting ranks it lives at least this often
# While waiting for groups, the demand is worked out again this often (a few
# LISTs): an expired claim or a refused batch opens new slots within a version.
REPLAN_SECONDS = 1.0


class RunConflict(RuntimeError):
    """The prefix holds a run this trainer must not take over."""


def warmup_lr(lr: float, version: int, warmup: int) -> float:
    """The rate of the update that makes version + 1: linear up to `lr` over
    `warmup` versions (a function of the version, so a resumed run goes on
    where it was)."""
    return lr * min(1.0, (version + 1) / warmup) if warmup > 0 else lr


def run_spec(cfg: TrainerConfig, files: dict[str, bytes], vocab: int, public: str) -> RunSpec:
    sp = asdict(run_sampling(cfg))
    sp["stop"] = list(sp["stop"])
    return RunSpec(
        run_id=uuid.uuid4().hex[:12],
        env=cfg.env,
        env_kwargs=dict(cfg.env_kwargs),
        model_files={name: digest_bytes(data, cfg.hash) for name, data in sorted(files.items())},
        trainer_key=public,
        inbox=cfg.inbox,
        inbox_endpoint_url=cfg.inbox_endpoint_url,
        vocab_size=vocab,
        precision=cfg.precision,
        group_size=cfg.group_size,
        groups_per_batch=cfg.groups_per_batch,
        groups_per_step=cfg.groups_per_step,
        max_lag=cfg.max_lag,
        anchor_every=cfg.anchor_every,
        sampling=sp,
        signed=bool(cfg.worker_keys),
    )


def trainer_key(cfg: TrainerConfig, store_url: str):
    """The trainer's private key: `--key`, else the one kept for this store in
    the local cache (made at the first start, 0600)."""
    if cfg.key:
        return load_private(Path(cfg.key))[1]
    path = (
        cache_root() / "trainer-keys" / f"{hashlib.sha256(store_url.encode()).hexdigest()[:16]}.key"
    )
    if not path.exists():
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

        # Every rank of a torchrun gets here: one makes the key, in a folder
        # of its own renamed into place (never half written), the others read it.
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".new-", dir=path.parent))
        write_private(tmp / "trainer.key", "trainer", Ed25519PrivateKey.generate())
        try:
            os.link(tmp / "trainer.key", path)
            os.replace(tmp / "trainer.pub", path.with_suffix(".pub"))
            log.info("made the trainer's key %s (keep it: a resume needs it)", path)
        except FileExistsError:
            pass  # another rank made it first
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_private(path)[1]


def _check_takeover(store: ObjectStore, cfg: TrainerConfig, signer: Signer) -> None:
    try:
        hb = read_signed(store, keys.HEARTBEAT, TrainerHeartbeat, signer.trust)
    except SchemaError as e:  # not this trainer's: anyone may have written it
        log.warning("%s is not this trainer's (%s): ignored", keys.HEARTBEAT, e)
        return
    if hb is None:
        return
    age = time.time() - hb.time
    if age < cfg.heartbeat_timeout and not cfg.takeover:
        raise RunConflict(
            f"another trainer ({hb.host}, {hb.instance}) wrote a heartbeat "
            f"{age:.0f} s ago under {store.url}; if it is dead, pass --takeover"
        )


def compute_dtype(dtype: str, device: torch.device) -> str:
    """bf16 or fp32: `auto` is bf16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return dtype


class Trainer:
    """The loop's state: policy, optimizer, and on rank 0 publisher and collector."""

    def __init__(self, cfg: TrainerConfig, store: ObjectStore | None = None):
        cfg.check()
        self.cfg = cfg
        self.where: Dist = init_distributed(
            cfg.device, cfg.store_outage_seconds + 1800, fsdp=cfg.fsdp
        )
        self.instance = uuid.uuid4().hex[:8]
        self.env = load_environment(cfg.env, **cfg.env_kwargs)
        torch.manual_seed(cfg.seed)
        texts = partial(tokenizer_texts_of, self.env)  # read only by the tiny preset
        self.model_dir = local_model_dir(resolve_model(cfg.model, texts))
        self.store = store or open_store(
            cfg.store,
            endpoint_url=cfg.endpoint_url,
            profile=cfg.profile,
            multipart_bytes=cfg.multipart_mb << 20,
        )
        self.private = trainer_key(cfg, self.store.url)
        self.signer: Signer | None = None  # once the run's id is known
        lm, self.tok = load_model(str(self.model_dir), dtype=torch.float32)
        self.aliases = tied_aliases(lm)
        self.max_len, self.vocab = lm.config.max_position_embeddings, lm.config.vocab_size
        self.dtype = compute_dtype(cfg.dtype, self.where.device)
        grad_ckpt = cfg.grad_ckpt if cfg.grad_ckpt is not None else self.where.device.type == "cuda"
        self.policy = build_policy(
            lm, self.where, self.dtype == "bf16", grad_ckpt, cfg.logit_chunk_tokens
        )
        self.opt = torch.optim.AdamW(
            self.policy.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.checkpoints = Checkpointer(
            self.store,
            self.policy,
            self.opt,
            self.where,
            Path(cfg.staging_dir or cache_root() / "staging"),
            self.aliases,
        )
        self.step_cfg = StepConfig(
            temperature=cfg.temperature,
            scale_by_std=cfg.scale_by_std,
            micro_tokens=cfg.micro_tokens,
            max_grad_norm=cfg.max_grad_norm,
            gate=GateConfig(cfg.delta_low, cfg.delta_high, cfg.ratio_clip),
            success=success_of(self.env),
            published=cfg.precision if cfg.forward_as_published else None,
        )
        self.version: int | None = None  # of the weights the policy holds
        self.background = Background()
        self.stop_requested = False
        self._last_command = time.monotonic()
        if self.where.leader:
            self._lead_state(cfg)
        log.info(
            "trainer on %s, %s compute, activation checkpointing %s, %d rank(s)",
            self.where.device,
            self.dtype,
            "on" if grad_ckpt else "off",
            self.where.world,
        )

    def _lead_state(self, cfg: TrainerConfig) -> None:
        log.info("trainer key %s", fingerprint(self.private.public_key()))
        self.spec: RunSpec | None = None
        self.collector: Collector | None = None
        self.quarantine = Ledger(
            QuarantineConfig(factor=cfg.quarantine_factor, min_tokens=cfg.quarantine_min_tokens)
        )
        self.exporter = None
        if cfg.metrics_port is not None:
            self.exporter = Exporter(cfg.metrics_port, "main", env_metrics=metrics_of(self.env))
        self._replanned = 0.0  # when the demand was last worked out while waiting
        self._wait_began: float | None = None  # the step's first wait for groups
        # Documents workers act on, as last written here: put back if replaced.
        self.guarded: dict[str, bytes] = {}
        self.model_bytes: dict[str, bytes] = {}  # the model files, as published
        self._model_times: dict[str, float] | None = None  # their store times, once checked

    def _bind_run(self, spec: RunSpec) -> None:
        """What needs the run: its id (signatures bind it) and its inbox."""
        cfg = self.cfg
        self.spec = spec
        self.signer = Signer(self.private, spec.run_id)
        self.checkpoints.signer = self.signer
        self.inbox = open_inbox(
            self.store,
            spec,
            endpoint_url=cfg.inbox_endpoint_url or cfg.endpoint_url,
            profile=cfg.inbox_profile or cfg.profile,
        )
        self.publisher = Publisher(
            self.store, self.signer, cfg.precision, cfg.anchor_every, cfg.hash
        )
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

    # -- what every rank does together, announced by rank 0 ------------------------------
    def _command(self, cmd: Command, arg: int = 0) -> None:
        self.where.command(cmd, arg)
        self._last_command = time.monotonic()

    def _train(self, groups, version: int) -> StepFigures | None:
        self._command(Command.STEP, version)
        for group in self.opt.param_groups:
            group["lr"] = warmup_lr(self.cfg.lr, version, self.cfg.warmup_versions)
        return train_step(
            self.policy, self.opt, groups, self.tok.pad_token_id, self.step_cfg, self.where
        )

    def _snapshot(self) -> dict[str, torch.Tensor]:
        self._command(Command.SNAPSHOT)
        return full_state(self.policy, self.where, self.aliases)

    def _save(self, v: int) -> None:
        self._command(Command.CHECKPOINT, v)
        self.checkpoints.save(v, {"instance": self.instance})
        if self.where.leader and self.cfg.keep_checkpoints > 0:
            prune_checkpoints(self.store, self.cfg.keep_checkpoints)

    def _load(self, v: int) -> None:
        self._command(Command.LOAD, v)
        self.checkpoints.load(v)

    def follow(self) -> None:
        """Ranks other than 0: do what rank 0 announces until it says DONE."""
        while True:
            cmd, arg = self.where.command()
            if cmd == Command.DONE:
                return
            if cmd == Command.STEP:
                for group in self.opt.param_groups:
                    group["lr"] = warmup_lr(self.cfg.lr, arg, self.cfg.warmup_versions)
                train_step(
                    self.policy, self.opt, None, self.tok.pad_token_id, self.step_cfg, self.where
                )
            elif cmd == Command.SNAPSHOT:
                full_state(self.policy, self.where, self.aliases)
            elif cmd == Command.CHECKPOINT:
                self.checkpoints.save(arg)
            elif cmd == Command.LOAD:
                self.checkpoints.load(arg)

    # -- start or resume (rank 0) ----------------------------------------------------------
    def open(self) -> None:
        self.store.clean_partial(keys.TRAINER, time.time())
        self.store.clean_partial(keys.WEIGHTS, time.time())
        resumed = self.store.exists(keys.RUN)
        if resumed:
            self._resume()
        else:
            self._start()
        if self.spec.signed and not self.cfg.worker_keys:
            raise RunConflict("this run requires signed batches: pass --worker-keys")
        train_ids = {t.id for t in self.env.tasks("train")}
        stop = episode_stops(self.spec.sampling["stop"], self.env)
        consumed, seen = self._consumed()
        max_tokens = self.cfg.max_episode_tokens + self.cfg.max_turn_tokens
        self.collector = Collector(
            self.inbox,
            self.spec.run_id,
            lambda g, v: rebuild_group(self.tok, self.env, g, v, stop, self.max_len, train_ids),
            vocab=self.spec.vocab_size,
            max_tokens=max_tokens,
            max_lag=self.cfg.max_lag,
            poll_seconds=self.cfg.poll_seconds,
            consumed=consumed,
            seen=seen,
            max_raw=batch_bytes_bound(
                self.spec.groups_per_batch * self.spec.group_size,
                max_tokens,
                self.spec.groups_per_batch,
            ),
        )
        self._restore_counts()
        self.quarantine.decisions = self._read_quarantine()
        self.collector.quarantined = set(self.quarantine.decisions)
        self.publisher.quarantined = len(self.quarantine.decisions)
        self._load_keys()
        if resumed:  # the demand from what the store holds, as if after a step
            try:
                latest = read_latest(self.store, self.signer.trust)
            except SchemaError:
                latest = None
            current = latest.demand if latest is not None else None
            self.publisher.announce(self._plan(self.version, self.version, current))

    def _plan(
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

    def _start(self) -> None:
        files = model_files(self.model_dir)
        for name, data in files.items():
            self.store.put(keys.model_file(name), data)
        self.model_bytes = files
        spec = run_spec(self.cfg, files, self.vocab, public_hex(self.private.public_key()))
        self._bind_run(spec)
        run = sealed(self.signer, keys.RUN, spec)
        if not self.store.put_if_absent(keys.RUN, run):
            raise RunConflict(f"another trainer created a run under {self.store.url} just now")
        self.guarded[keys.RUN] = run
        self._heartbeat(None)
        self._save(0)
        meta = self.publisher.publish(self._snapshot(), self.first_demand()).meta
        self.version = 0
        log.info("run %s: published v0 (%d bytes, full)", spec.run_id, meta.anchor_bytes)

    def _resume(self) -> None:
        if not self.cfg.resume:
            raise RunConflict(f"a run already exists under {self.store.url} (resume is off)")
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
        self._bind_run(RunSpec.from_dict(doc))
        self.guarded[keys.RUN] = data
        files = model_files(self.model_dir)
        self.model_bytes = {n: files[n] for n in self.spec.model_files if n in files}
        _check_takeover(self.store, self.cfg, self.signer)
        ckpt = latest_checkpoint(self.store, self.signer.trust)
        if ckpt is None:
            raise RunConflict(f"the run under {self.store.url} has no checkpoint to resume from")
        self._load(ckpt)
        latest = latest_version(self.store, self.signer.trust)
        if latest is not None:
            follower = Follower(self.store, self.spec.anchor_every, self.signer.trust)
            follower.sync(latest)
            # The publisher takes the follower's tensors as they are: this
            # follower never syncs again (it would rebuild them in place).
            self.publisher.adopt(latest, follower.state, follower.state_hash)
        if latest is None or latest < ckpt:
            # The checkpoint's own version never got published (a crash while
            # it was in flight): publish those weights as that version now.
            if (latest if latest is not None else -1) != ckpt - 1:
                raise VersionError(f"checkpoint v{ckpt} is ahead of the published v{latest}")
            self.publisher.publish(self._snapshot())
        self.version = self.publisher.version
        lost = (
            f"; the updates of v{ckpt + 1}..v{latest} are lost" if latest and latest > ckpt else ""
        )
        log.info(
            "resumed run %s from checkpoint v%d at v%d%s",
            self.spec.run_id,
            ckpt,
            self.version,
            lost,
        )

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

    def _write_quarantine(self) -> None:
        doc = sealed(self.signer, keys.QUARANTINE, Quarantine(dict(self.quarantine.decisions)))
        self.store.put(keys.QUARANTINE, doc)
        self.guarded[keys.QUARANTINE] = doc

    def _guard(self) -> int:
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

    def _load_keys(self) -> None:
        """Re-read the registered public keys and publish them (trainer/keys.json)."""
        if not self.cfg.worker_keys:
            return
        ring = load_keyring(Path(self.cfg.worker_keys))
        if ring.keys() != (self.collector.keyring or {}).keys():
            self.store.put(keys.KEYRING, self.signer.seal(keys.KEYRING, keyring_json(ring)))
            log.info("registered worker keys: %s", ", ".join(sorted(ring)))
        self.collector.keyring = ring

    # -- the loop (rank 0) ---------------------------------------------------------------
    def _heartbeat(self, version: int | None) -> None:
        hb = TrainerHeartbeat(self.instance, socket.gethostname(), time.time(), version)
        write_signed(self.store, keys.HEARTBEAT, hb, self.signer)

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

    def _registered(self) -> set[str] | None:
        ring = self.collector.keyring
        return set(ring) if ring is not None else None

    def workers_alive(self) -> int:
        """Workers whose heartbeat is younger than heartbeat_timeout (registered
        ones only, in a signed run)."""
        listing = list_inbox(self.inbox, self._registered())
        return len(fresh_workers(listing, time.time(), self.cfg.heartbeat_timeout))

    def _waiting(self, v: int, taken: int) -> bool:
        """Polled while collecting for the step at v, `taken` groups so far:
        keeps the other ranks' collectives alive and the demand current; True
        once a stop is requested."""
        if self.where.sharded and time.monotonic() - self._last_command > PING_SECONDS:
            self._command(Command.PING)
        now = time.monotonic()
        if self._wait_began is None:
            self._wait_began = now
        elif min(now - self._wait_began, now - self._replanned) > REPLAN_SECONDS:
            self._replan(v, taken)
            try:
                self._guard()
            except StoreError as e:
                log.warning("documents not checked: %s", e)
        return self.stop_requested

    def _replan(self, v: int, taken: int) -> None:
        """While waiting: the demand again, for the newest published version
        and the shortfall of this step (best effort: the next poll tries
        again after a store error)."""
        self._replanned = time.monotonic()
        target, current = self.publisher.version, self.publisher.demand
        if target is None:
            return
        try:
            demand = self._plan(v, target, current, taken=taken, current_step_only=True)
            if self.publisher.announce(demand) and current is not None:
                log.info("demand for v%d: %d slots (was %d)", target, demand.slots, current.slots)
        except StoreError as e:
            log.warning("demand not updated: %s", e)

    def step(self) -> TrainerRow | None:
        """Train on one collection; hand v+1 to the background publication; its
        row (the publication's figures are added in the background).

        None when a stop was requested while waiting for rollouts: nothing is
        trained or recorded as consumed, so a resumed run uses those batches.
        Store outages are retried (collection, ledger, publication) up to
        `store_outage_seconds`; the update itself is made once.
        """
        t0 = time.monotonic()
        deadline = self.cfg.store_outage_seconds
        self._retry("keys", self._load_keys, deadline)
        self._retry("guard", self._guard, deadline)
        v = self.version
        counts = self.collector.counts
        before = counts["batches_rejected"] + counts["groups_rejected"]
        need = self.cfg.groups_per_step
        self._wait_began = None
        got = self._retry(
            "collect",
            lambda: self.collector.collect(v, need, stop=lambda n: self._waiting(v, n)),
            deadline,
        )
        if len(got.groups) < need:
            return None
        figures = self._train(got.groups, v)
        self._retry("ledger", lambda: self._write_ledger(v + 1, got), deadline)
        state = self._snapshot()
        self.version = v + 1
        alive = self._retry("workers", self.workers_alive, deadline)
        if self.quarantine.judge(v + 1, figures.gate_by_version):
            self.collector.quarantined = set(self.quarantine.decisions)
            self._retry("quarantine", self._write_quarantine, deadline)
            # Announced by the next latest.json, written after quarantine.json.
            self.publisher.quarantined = len(self.quarantine.decisions)
        blocked = self.background.wait()
        step_seconds = time.monotonic() - t0
        self.collector.version_gap = moving_gap(self.collector.version_gap, step_seconds)
        step_fields = figures.row_fields()
        # The row carries the metrics the environment declares for display.
        means = step_fields["env_metrics"]
        step_fields["env_metrics"] = {
            m.name: means[m.name] for m in metrics_of(self.env) if m.name in means
        }
        row = TrainerRow(
            time=time.time(),
            version=v + 1,
            **step_fields,
            staleness={str(k): n for k, n in sorted(got.staleness.items())},
            wait_seconds=round(got.wait_seconds, 3),
            rejected=counts["batches_rejected"] + counts["groups_rejected"] - before,
            batches_trained=len(got.keys),
            workers_alive=alive,
            per_worker={w: dict(c) for w, c in sorted(self.collector.per_worker.items())},
            counts={k: int(n) for k, n in counts.items()},
            step_seconds=round(step_seconds, 3),
            wait_fraction=round(got.wait_seconds / max(step_seconds, 1e-9), 4),
            publish_blocked_seconds=round(blocked, 3),
            peak_mem_mb=round(peak_memory_mb(self.where.device), 1),
        )
        # The demand for v+1 is worked out in the background, against what was
        # consumed up to now: the next step may take groups meanwhile.
        consumed = set(self.collector.consumed)
        self.background.submit(lambda: self._publish(state, row, consumed))
        self._retry("heartbeat", lambda: self._heartbeat(v + 1), deadline)
        if (v + 1) % self.cfg.checkpoint_every == 0:
            self._retry("checkpoint", lambda: self._save(v + 1), deadline)
        return row

    def _retry(self, what: str, fn, deadline_s: float):
        return retry_unavailable(log, what, fn, deadline_s)

    def _write_ledger(self, new_v: int, got) -> None:
        """The batches that trained `new_v`, recorded before it is published."""
        ledger = ConsumedLedger(sorted(got.keys), sorted(got.rejected), sorted(got.digests))
        write_signed(self.store, keys.consumed_key(new_v, self.instance), ledger, self.signer)

    def _publish(self, state: dict[str, torch.Tensor], row: TrainerRow, consumed: set[str]) -> None:
        """Background: publish the snapshot as the next version with its
        demand, then its metrics row."""
        v = row.version
        demand = self._retry(
            "demand", lambda: self._plan(v, v, consumed=consumed), self.cfg.store_outage_seconds
        )
        pub = self._retry(
            "publish", lambda: self.publisher.publish(state, demand), self.cfg.store_outage_seconds
        )
        m = replace(
            row,
            deleted=self._retry(
                "retention",
                lambda: self.retention.sweep(pub.meta.version, self._registered()),
                self.cfg.store_outage_seconds,
            ),
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

    def install_stop(self) -> None:
        """SIGTERM: finish the version in flight, checkpoint, exit (resumable).
        Only rank 0 decides; under torchrun every rank gets the signal."""

        def handler(signum, frame):
            if self.where.leader:
                log.info("stopping after the version in flight (signal %d)", signum)
            self.stop_requested = True

        signal.signal(signal.SIGTERM, handler)

    def run(self) -> None:
        finished = False
        try:
            if self.where.leader:
                self._lead()
            else:
                self.follow()
            finished = True
        finally:
            self.background.close()
            if finished:
                # Every rank is past its last collective before any tears the
                # group down: a gloo rank whose peer left mid-teardown was once
                # aborted at exit (SIGABRT after "done"). Not after an error: a
                # dead peer would hold the barrier until the group's timeout.
                self.where.barrier()
            self.where.close()

    def _lead(self) -> None:
        self.open()
        while self.version < self.cfg.max_versions:
            if self.stop_requested:
                self.background.wait()
                self._save(self.version)
                log.info("stopped at v%d (checkpointed; the run can resume)", self.version)
                self._command(Command.DONE)
                return
            self.step()
        self.background.wait()
        write_signed(self.store, keys.DONE, Done(self.version, time.time()), self.signer)
        self.publisher.point(done=True)  # what workers poll
        self._command(Command.DONE)
        log.info("done: published v%d", self.version)
