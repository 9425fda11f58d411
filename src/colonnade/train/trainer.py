"""The trainer: one process that updates the weights and publishes versions.

    start:  run.json (put-if-absent), model files, checkpoint v0, publish v0
    loop:   collect groups (v − max_lag … v) → recompute rewards → DPPO step
            → record consumed batches → publish v+1 (patch; anchor every K)
            → metrics, heartbeat; checkpoint every N versions
    end:    trainer/done.json, which tells workers to stop

Resuming loads the newest checkpoint and continues after the newest
*published* version: version numbers are never skipped or reused, and
batches recorded as consumed are never used again (updates made after the
checkpoint are lost; their batches stay consumed).
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from colonnade.envs import load_environment
from colonnade.model import load_model, publishable_state, resolve_model
from colonnade.protocol import Follower, Publisher, RunSpec, keys, latest_version
from colonnade.protocol.polling import moving_gap
from colonnade.protocol.presence import alive, worker_heartbeats
from colonnade.protocol.schemas import MAX_JSON_BYTES, dumps, loads
from colonnade.protocol.signing import keyring_json, load_keyring
from colonnade.rollout.episodes import episode_stops
from colonnade.rollout.sampling import SamplingParams
from colonnade.store import NotFound, ObjectStore, open_store
from colonnade.store.retry import retry_unavailable
from colonnade.telemetry import Exporter, Telemetry

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .collect import Collector
from .loss import GateConfig
from .quarantine import Ledger, QuarantineConfig
from .samples import rebuild_group
from .step import StepConfig, train_step

log = logging.getLogger("colonnade.trainer")
MODEL_FILE_LIMIT = 64 << 20


class RunConflict(RuntimeError):
    """The prefix holds a run this trainer must not take over."""


@dataclass
class TrainerConfig:
    store: str = ""
    endpoint_url: str | None = None
    env: str = "smoke"
    env_kwargs: dict = field(default_factory=dict)
    model: str = "tiny"
    precision: str = "int8"  # of published weights: what workers run
    max_versions: int = 20  # stop once this version is published
    max_lag: int = 2  # 0: synchronous on-policy
    anchor_every: int = 10
    group_size: int = 8
    groups_per_step: int = 8
    groups_per_batch: int = 2  # per worker upload
    lr: float = 1e-5
    # Linear warm-up of the rate over the first versions: Adam's first updates
    # move every weight by about the full rate, and a smoke run at 3e-4 with
    # none collapsed at v4 (mismatch KL 1.9, every reward 0 after).
    warmup_versions: int = 10
    weight_decay: float = 0.0
    temperature: float = 1.0
    max_turn_tokens: int = 96
    max_episode_tokens: int = 512
    delta_low: float = 0.15
    delta_high: float = 0.15
    ratio_clip: float = 2.0
    micro_batch: int = 8
    checkpoint_every: int = 5
    poll_seconds: float = 1.0
    resume: bool = True  # continue a run found under the prefix
    takeover: bool = False  # ignore a fresh heartbeat of another trainer
    heartbeat_timeout: float = 60.0
    metrics_port: int | None = None  # serve Prometheus metrics on this port
    store_outage_seconds: float = 900.0  # keep retrying an unavailable store this long
    # Registered workers' public keys: a .pub file or a directory of them,
    # re-read every step so workers can be added mid-run. Set: every batch
    # must be signed by its worker's key. Empty: unsigned batches are taken.
    worker_keys: str = ""
    quarantine_factor: float = 5.0  # × the fleet's median mismatch; 0: never quarantine
    quarantine_min_tokens: int = 400
    seed: int = 0

    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            max_turn_tokens=self.max_turn_tokens,
            max_episode_tokens=self.max_episode_tokens,
        )


def warmup_lr(lr: float, version: int, warmup: int) -> float:
    """The rate of the update that makes version + 1: linear up to `lr` over
    `warmup` versions (a function of the version, so a resumed run goes on
    where it was)."""
    return lr * min(1.0, (version + 1) / warmup) if warmup > 0 else lr


def _model_files(model_dir: Path) -> dict[str, bytes]:
    """Everything but weights: config, tokenizer, generation config."""
    out = {}
    for p in sorted(model_dir.iterdir()):
        if p.is_file() and not p.name.endswith((".safetensors", ".bin")) and p.stat().st_size:
            if p.stat().st_size > MODEL_FILE_LIMIT:
                raise ValueError(f"{p}: larger than {MODEL_FILE_LIMIT} bytes")
            out[p.name] = p.read_bytes()
    return out


def run_spec(cfg: TrainerConfig, files: list[str], vocab: int) -> RunSpec:
    sp = asdict(cfg.sampling())
    sp["stop"] = list(sp["stop"])
    return RunSpec(
        run_id=uuid.uuid4().hex[:12],
        env=cfg.env,
        env_kwargs=dict(cfg.env_kwargs),
        model_files=files,
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


def _check_takeover(store: ObjectStore, cfg: TrainerConfig) -> None:
    try:
        hb = loads(store.get(keys.HEARTBEAT, max_bytes=MAX_JSON_BYTES))
    except NotFound:
        return
    age = time.time() - float(hb.get("time", 0))
    if age < cfg.heartbeat_timeout and not cfg.takeover:
        raise RunConflict(
            f"another trainer ({hb.get('host')}, {hb.get('instance')}) wrote a heartbeat "
            f"{age:.0f} s ago under {store.url}; if it is dead, pass --takeover"
        )


class Trainer:
    """The loop's state: model, optimizer, publisher, collector."""

    def __init__(self, cfg: TrainerConfig, store: ObjectStore | None = None):
        self.cfg = cfg
        self.store = store or open_store(cfg.store, endpoint_url=cfg.endpoint_url)
        self.instance = uuid.uuid4().hex[:8]
        self.env = load_environment(cfg.env, **cfg.env_kwargs)
        torch.manual_seed(cfg.seed)
        path = resolve_model(cfg.model, self.env.tokenizer_texts())
        self.model, self.tok = load_model(path, dtype=torch.float32)
        self.model_dir = Path(path)
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay
        )
        self.publisher = Publisher(self.store, cfg.precision, cfg.anchor_every)
        self.step_cfg = StepConfig(
            temperature=cfg.temperature,
            micro_batch=cfg.micro_batch,
            gate=GateConfig(cfg.delta_low, cfg.delta_high, cfg.ratio_clip),
        )
        self.spec: RunSpec | None = None
        self.collector: Collector | None = None
        self.quarantine = Ledger(
            QuarantineConfig(factor=cfg.quarantine_factor, min_tokens=cfg.quarantine_min_tokens)
        )
        exporter = Exporter(cfg.metrics_port, "main") if cfg.metrics_port is not None else None
        self.telemetry = Telemetry(self.store, "trainer", "main", 0.0, exporter)
        self.stop_requested = False

    # -- start or resume ------------------------------------------------------------
    def open(self) -> None:
        if self.store.exists(keys.RUN):
            self._resume()
        else:
            self._start()
        train_ids = {t.id for t in self.env.tasks("train")}
        stop = episode_stops(self.spec.sampling["stop"], self.env)
        max_len = self.model.config.max_position_embeddings
        consumed, seen = self._consumed()
        self.collector = Collector(
            self.store,
            lambda g, v: rebuild_group(self.tok, self.env, g, v, stop, max_len, train_ids),
            vocab=self.spec.vocab_size,
            max_tokens=self.cfg.max_episode_tokens + self.cfg.max_turn_tokens,
            max_lag=self.cfg.max_lag,
            poll_seconds=self.cfg.poll_seconds,
            consumed=consumed,
            seen=seen,
        )
        self.quarantine.decisions = self._read_quarantine()
        self.collector.quarantined = set(self.quarantine.decisions)
        if self.spec.signed and not self.cfg.worker_keys:
            raise RunConflict("this run requires signed batches: pass --worker-keys")
        self._load_keys()

    def _start(self) -> None:
        files = _model_files(self.model_dir)
        for name, data in files.items():
            self.store.put(keys.model_file(name), data)
        spec = run_spec(self.cfg, sorted(files), self.model.config.vocab_size)
        if not self.store.put_if_absent(keys.RUN, spec.to_json()):
            raise RunConflict(f"another trainer created a run under {self.store.url} just now")
        self.spec = spec
        self._heartbeat(None)
        save_checkpoint(self.store, 0, self.model, self.opt, {"instance": self.instance})
        meta = self.publisher.publish(publishable_state(self.model)).meta
        log.info("run %s: published v0 (%d bytes, full)", spec.run_id, meta.payload_bytes)

    def _resume(self) -> None:
        if not self.cfg.resume:
            raise RunConflict(f"a run already exists under {self.store.url} (resume is off)")
        _check_takeover(self.store, self.cfg)
        self.spec = RunSpec.from_json(self.store.get(keys.RUN, max_bytes=MAX_JSON_BYTES))
        ckpt = latest_checkpoint(self.store)
        if ckpt is None:
            raise RunConflict(f"the run under {self.store.url} has no checkpoint to resume from")
        load_checkpoint(self.store, ckpt, self.model, self.opt)
        latest = latest_version(self.store)
        if latest is None:  # died between the v0 checkpoint and v0
            self.publisher.publish(publishable_state(self.model))
            return
        follower = Follower(self.store, self.spec.anchor_every)
        follower.sync(latest)
        self.publisher.adopt(latest, follower.state, follower.sha)
        lost = f"; the updates of v{ckpt + 1}..v{latest} are lost" if latest > ckpt else ""
        log.info(
            "resumed run %s from checkpoint v%d at v%d%s", self.spec.run_id, ckpt, latest, lost
        )

    def _consumed(self) -> tuple[set[str], set[str]]:
        """(keys, payload digests) of every batch a trainer of this run took."""
        taken: set[str] = set()
        seen: set[str] = set()
        for key in self.store.list("trainer/consumed/"):
            doc = json.loads(self.store.get(key, max_bytes=64 << 20))
            taken.update(doc["keys"])
            seen.update(doc["digests"])
        return taken, seen

    def _read_quarantine(self) -> dict:
        try:
            return loads(self.store.get(keys.QUARANTINE, max_bytes=MAX_JSON_BYTES))
        except NotFound:
            return {}

    def _write_quarantine(self) -> None:
        self.store.put(keys.QUARANTINE, dumps(self.quarantine.decisions))

    def _load_keys(self) -> None:
        """Re-read the registered public keys and publish them (trainer/keys.json)."""
        if not self.cfg.worker_keys:
            return
        ring = load_keyring(Path(self.cfg.worker_keys))
        if ring.keys() != (self.collector.keyring or {}).keys():
            self.store.put(keys.KEYRING, keyring_json(ring))
            log.info("registered worker keys: %s", ", ".join(sorted(ring)))
        self.collector.keyring = ring

    # -- the loop ---------------------------------------------------------------------
    def _heartbeat(self, version: int | None) -> None:
        doc = {
            "instance": self.instance,
            "host": socket.gethostname(),
            "time": time.time(),
            "version": version,
        }
        self.store.put(keys.HEARTBEAT, dumps(doc))

    def workers_alive(self) -> int:
        """Workers whose heartbeat is younger than heartbeat_timeout."""
        return len(alive(worker_heartbeats(self.store), time.time(), self.cfg.heartbeat_timeout))

    def step(self) -> dict | None:
        """Train on one collection and publish the next version; its metrics.

        None when a stop was requested while waiting for rollouts: nothing is
        trained or recorded as consumed, so a resumed run uses those batches.
        Store outages are retried (collection, then publication) up to
        `store_outage_seconds`; the update itself is made once.
        """
        t0 = time.monotonic()
        deadline = self.cfg.store_outage_seconds
        self._retry("keys", self._load_keys, deadline)
        v = self.publisher.version
        before = sum(self.collector.counts[k] for k in ("batches_rejected", "groups_rejected"))
        got = self._retry(
            "collect",
            lambda: self.collector.collect(
                v, self.cfg.groups_per_step, stop=lambda: self.stop_requested
            ),
            deadline,
        )
        if len(got.groups) < self.cfg.groups_per_step:
            return None
        for group in self.opt.param_groups:
            group["lr"] = warmup_lr(self.cfg.lr, v, self.cfg.warmup_versions)
        metrics = train_step(self.model, self.opt, got.groups, self.tok.pad_token_id, self.step_cfg)
        pub = self._retry("publish", lambda: self._commit(v + 1, got), deadline)
        rejected = sum(self.collector.counts[k] for k in ("batches_rejected", "groups_rejected"))
        step_seconds = time.monotonic() - t0
        self.collector.version_gap = moving_gap(self.collector.version_gap, step_seconds)
        metrics.update(
            version=v + 1,
            staleness={str(k): n for k, n in sorted(got.staleness.items())},
            wait_seconds=round(got.wait_seconds, 3),
            step_seconds=round(step_seconds, 3),
            wait_fraction=round(got.wait_seconds / max(step_seconds, 1e-9), 4),
            publish_seconds=round(pub.seconds, 3),
            patch_bytes=pub.meta.payload_bytes,
            full_bytes=pub.meta.full_bytes,
            kind=pub.meta.kind,
            rejected=rejected - before,
            workers_alive=self._retry("workers", self.workers_alive, deadline),
            per_worker={w: dict(c) for w, c in sorted(self.collector.per_worker.items())},
            **{k: int(n) for k, n in self.collector.counts.items()},
        )
        if self.quarantine.judge(v + 1, metrics.pop("gate_by_version")):
            self.collector.quarantined = set(self.quarantine.decisions)
            self._retry("quarantine", self._write_quarantine, deadline)
        self.telemetry.row(**metrics)
        self._retry("heartbeat", lambda: self._heartbeat(v + 1), deadline)
        if (v + 1) % self.cfg.checkpoint_every == 0:
            self._retry("checkpoint", lambda: self._checkpoint(v + 1), deadline)
        return metrics

    def _retry(self, what: str, fn, deadline_s: float):
        return retry_unavailable(log, what, fn, deadline_s)

    def _commit(self, new_v: int, got):
        """Ledger, then the version: safe to repeat after a failed attempt."""
        ledger = keys.consumed_key(new_v).replace(".json", f"-{self.instance}.json")
        doc = {"keys": sorted(got.keys), "digests": sorted(got.digests)}
        self.store.put(ledger, json.dumps(doc).encode())
        return self.publisher.publish(publishable_state(self.model))

    def _checkpoint(self, v: int) -> None:
        save_checkpoint(self.store, v, self.model, self.opt, {"instance": self.instance})

    def install_stop(self) -> None:
        """SIGTERM: finish the version in flight, checkpoint, exit (resumable)."""

        def handler(signum, frame):
            log.info("stopping after the version in flight (signal %d)", signum)
            self.stop_requested = True

        signal.signal(signal.SIGTERM, handler)

    def run(self) -> None:
        self.open()
        while self.publisher.version < self.cfg.max_versions:
            if self.stop_requested:
                v = self.publisher.version
                self._checkpoint(v)
                log.info("stopped at v%d (checkpointed; the run can resume)", v)
                return
            m = self.step()
            if m is None:
                continue
            log.info(
                "v%d loss %.4f reward %.3f pass %.2f masked %.4f kl %.4f tokens %d "
                "wait %.1fs patch %d B (%.2f%% of full)",
                m["version"],
                m["loss"],
                m["reward_mean"],
                m["pass_rate"],
                m["masked_fraction"],
                m["mismatch_kl"],
                m["tokens"],
                m["wait_seconds"],
                m["patch_bytes"],
                100 * m["patch_bytes"] / max(1, m["full_bytes"]),
            )
        self.store.put(keys.DONE, dumps({"version": self.publisher.version, "time": time.time()}))
        log.info("done: published v%d", self.publisher.version)
