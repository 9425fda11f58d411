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
trainer reads as hostile (train/collect.py, train/demand.py; a share of
rows recomputed on the published weights, train/spot.py) and keeps bounded
(train/retention.py). Between steps and while waiting it checks
that run.json, latest.json and quarantine.json are still what it wrote,
and writes them again if anyone replaced them (`Lead.guard`).

Rank 0 leads: it runs the loop below and announces each collective to the
other ranks, which hold their shards and follow its commands (`follow`);
its store work (the run's documents, rollouts, versions, metrics) is the
`Lead`'s (train/lead.py), which waits out store outages for it.

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
import tempfile
import time
import uuid
from dataclasses import asdict
from functools import partial
from pathlib import Path

import torch

from colonnade.background import Background
from colonnade.config import TrainerConfig
from colonnade.envs import load_environment, metrics_of, success_of, tokenizer_texts_of
from colonnade.model import (
    cache_root,
    load_model,
    load_tokenizer,
    local_model_dir,
    lora,
    resolve_model,
    skeleton,
    tied_aliases,
)
from colonnade.model.device import peak_memory_mb
from colonnade.protocol import Follower, RunSpec, keys, latest_version
from colonnade.protocol.draws import forged_draws
from colonnade.protocol.metrics import TrainerRow
from colonnade.protocol.model_files import model_files
from colonnade.protocol.polling import moving_gap
from colonnade.protocol.signing import (
    Signer,
    load_keyring,
    load_private,
    public_hex,
    write_private,
)
from colonnade.protocol.turns import SamplingParams, episode_stops, run_sampling
from colonnade.protocol.weights import VersionError
from colonnade.pulse.hashing import digest_bytes
from colonnade.store import ObjectStore, open_store

from .checkpoint import Checkpointer, latest_checkpoint
from .distributed import Command, Dist, init_distributed
from .lead import Lead, RunConflict
from .loss import GateConfig
from .policy import build_policy, full_state
from .samples import rebuild_group
from .spot import SpotChecker, Tolerance
from .step import StepConfig, StepFigures, train_step, warmup_lr

log = logging.getLogger("colonnade.trainer")
PING_SECONDS = 20.0  # rank 0 tells waiting ranks it lives at least this often


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


def compute_dtype(dtype: str, device: torch.device) -> str:
    """bf16 or fp32: `auto` is bf16 on CUDA, fp32 elsewhere."""
    if dtype == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    return dtype


def lora_spec(cfg: TrainerConfig) -> lora.LoraSpec | None:
    """The run's LoRA adapters, None for full fine-tuning."""
    if not cfg.lora_rank:
        return None
    return lora.LoraSpec(cfg.lora_rank, cfg.lora_scale_alpha, cfg.lora_target_names)


class Trainer:
    """The loop's state: policy, optimizer, and on rank 0 its `Lead`."""

    def __init__(self, cfg: TrainerConfig, store: ObjectStore | None = None):
        cfg.check()
        for ring in (cfg.worker_keys, cfg.trusted_keys):
            if ring:
                # Read before anything is written: a folder without a worker's
                # .pub (or a bad one) is the user's, refused in one line.
                load_keyring(Path(ring))
        self.cfg = cfg
        self.where: Dist = init_distributed(
            cfg.device, cfg.store_outage_seconds + 1800, fsdp=cfg.fsdp or cfg.cpu_offload
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
        if self.where.sharded:
            # Each rank reads only its own rows of the weights (train/loading.py).
            lm, source = skeleton(self.model_dir), self.model_dir
            self.tok = load_tokenizer(str(self.model_dir))
        else:
            (lm, self.tok), source = load_model(str(self.model_dir), dtype=torch.float32), None
        self.aliases = tied_aliases(lm)
        self.max_len, self.vocab = lm.config.max_position_embeddings, lm.config.vocab_size
        self.dtype = compute_dtype(cfg.dtype, self.where.device)
        grad_ckpt = cfg.grad_ckpt if cfg.grad_ckpt is not None else self.where.device.type == "cuda"
        self.policy = build_policy(
            lm,
            self.where,
            self.dtype == "bf16",
            grad_ckpt,
            cfg.logit_chunk_tokens,
            source,
            cpu_offload=cfg.cpu_offload,
            adapters=lora_spec(cfg),
            seed=cfg.seed,
        )
        trained = [p for p in self.policy.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trained, lr=cfg.rate, weight_decay=cfg.weight_decay)
        self.checkpoints = Checkpointer(
            self.store,
            self.policy,
            self.opt,
            self.where,
            Path(cfg.staging_dir or cache_root() / "staging"),
            self.aliases,
            keep=cfg.keep_checkpoints,
            outage_seconds=cfg.store_outage_seconds,
            background_write=self.where.device.type == "cuda",
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
        self.lead: Lead | None = None  # rank 0's duties beyond the weights
        if self.where.leader:
            self.lead = Lead(cfg, self.store, self.private, self.instance, self.env, self._save)
        log.info(
            "trainer on %s, %s compute, activation checkpointing %s, %d rank(s)",
            self.where.device,
            self.dtype,
            "on" if grad_ckpt else "off",
            self.where.world,
        )

    def _bind_run(self, spec: RunSpec) -> None:
        """What needs the run: its id, which signatures bind (the lead's
        documents, the checkpoints)."""
        self.signer = self.lead.bind(spec)
        self.checkpoints.signer = self.signer

    # -- what every rank does together, announced by rank 0 ------------------------------
    def _command(self, cmd: Command, arg: int = 0) -> None:
        self.where.command(cmd, arg)
        self._last_command = time.monotonic()

    def _train(self, groups, version: int) -> StepFigures | None:
        self._command(Command.STEP, version)
        for group in self.opt.param_groups:
            group["lr"] = warmup_lr(self.cfg.rate, version, self.cfg.warmup_versions)
        return train_step(
            self.policy, self.opt, groups, self.tok.pad_token_id, self.step_cfg, self.where
        )

    def _snapshot(self, adapters_only: bool = False) -> dict[str, torch.Tensor]:
        self._command(Command.SNAPSHOT, int(adapters_only))
        return full_state(self.policy, self.where, self.aliases, adapters_only)

    def _save(self, v: int) -> None:
        """A checkpoint of v: written locally now, uploaded and committed (and
        older ones pruned) in the background while the next steps train."""
        self._command(Command.CHECKPOINT, v)
        self.checkpoints.save(v, {"instance": self.instance})

    def _load(self, v: int) -> None:
        self._command(Command.LOAD, v)
        self.checkpoints.load(v)

    def follow(self) -> None:
        """Ranks other than 0: do what rank 0 announces until it says DONE."""
        while True:
            cmd, arg = self.where.command()
            if cmd == Command.DONE:
                self.checkpoints.finish()
                return
            if cmd == Command.STEP:
                for group in self.opt.param_groups:
                    group["lr"] = warmup_lr(self.cfg.rate, arg, self.cfg.warmup_versions)
                train_step(
                    self.policy, self.opt, None, self.tok.pad_token_id, self.step_cfg, self.where
                )
            elif cmd == Command.SNAPSHOT:
                full_state(self.policy, self.where, self.aliases, bool(arg))
            elif cmd == Command.CHECKPOINT:
                self.checkpoints.save(arg)
            elif cmd == Command.LOAD:
                self.checkpoints.load(arg)

    # -- start or resume (rank 0) ----------------------------------------------------------
    def open(self) -> None:
        lead = self.lead
        self.store.clean_partial(keys.TRAINER, time.time())
        self.store.clean_partial(keys.WEIGHTS, time.time())
        resumed = self.store.exists(keys.RUN)
        if resumed:
            self._resume()
        else:
            self._start()
        if lead.spec.signed and not self.cfg.worker_keys:
            raise RunConflict("this run requires signed batches: pass --worker-keys")
        train = [t.id for t in self.env.tasks("train")]
        train_ids = set(train)
        spec = lead.spec
        stop = episode_stops(spec.sampling["stop"], self.env)
        sampled = spec.sampling.get("temperature", 1.0) > 0
        lead.start_collecting(
            lambda g, v: rebuild_group(self.tok, self.env, g, v, stop, self.max_len, train_ids),
            lambda b: forged_draws(b, spec.run_id, train, spec.groups_per_batch, sampled),
            self._spot_checker(spec),
        )
        if self.cfg.trusted_keys:  # whose rewards it takes where it cannot recompute them
            lead.collector.trusted = load_keyring(Path(self.cfg.trusted_keys))
        if resumed:
            lead.announce_resumed(self.version)

    def _spot_checker(self, spec: RunSpec) -> SpotChecker | None:
        """Spot checks of the run's rows on a CPU model of its own (None: off)."""
        cfg = self.cfg
        if cfg.spot_rate <= 0:
            return None
        sampling = {**spec.sampling, "stop": tuple(spec.sampling.get("stop", ()))}
        return SpotChecker(
            lambda: skeleton(self.model_dir),  # each version's tensors made from its state
            self.tok,
            self.env,
            SamplingParams(**sampling),
            spec.precision,
            cfg.spot_rate,
            Tolerance(cfg.spot_logp_tolerance, cfg.spot_interval_tolerance),
            keep=cfg.max_lag + 1,
        )

    def _start(self) -> None:
        lead = self.lead
        files = lead.put_model(model_files(self.model_dir))
        spec = run_spec(self.cfg, files, self.vocab, public_hex(self.private.public_key()))
        self._bind_run(spec)
        lead.create_run()
        lead.heartbeat(None)
        self._save(0)
        meta = lead.publisher.publish(self._snapshot(), lead.first_demand()).meta
        self.version = 0
        log.info("run %s: published v0 (%d bytes, full)", spec.run_id, meta.anchor_bytes)

    def _resume(self) -> None:
        if not self.cfg.resume:
            raise RunConflict(f"a run already exists under {self.store.url} (resume is off)")
        lead = self.lead
        spec, run = lead.read_run()
        self._bind_run(spec)
        lead.adopt_run(run, model_files(self.model_dir))
        lead.check_takeover()
        ckpt = latest_checkpoint(self.store, self.signer.trust)
        if ckpt is None:
            raise RunConflict(f"the run under {self.store.url} has no checkpoint to resume from")
        self._load(ckpt)
        latest = latest_version(self.store, self.signer.trust)
        if latest is not None:
            follower = Follower(self.store, spec.anchor_every, self.signer.trust)
            follower.sync(latest)
            # The publisher takes the follower's tensors as they are: this
            # follower never syncs again (it would rebuild them in place).
            lead.publisher.adopt(latest, follower.state, follower.state_hash)
        if latest is None or latest < ckpt:
            # The checkpoint's own version never got published (a crash while
            # it was in flight): publish those weights as that version now.
            if (latest if latest is not None else -1) != ckpt - 1:
                raise VersionError(f"checkpoint v{ckpt} is ahead of the published v{latest}")
            lead.publisher.publish(self._snapshot())
        self.version = lead.publisher.version
        lost = (
            f"; the updates of v{ckpt + 1}..v{latest} are lost" if latest and latest > ckpt else ""
        )
        log.info(
            "resumed run %s from checkpoint v%d at v%d%s",
            spec.run_id,
            ckpt,
            self.version,
            lost,
        )

    # -- the loop (rank 0) ---------------------------------------------------------------
    def _waiting(self, v: int, taken: int) -> bool:
        """Polled while collecting for the step at v, `taken` groups so far:
        keeps the other ranks' collectives alive and the demand current; True
        once a stop is requested."""
        if self.where.sharded and time.monotonic() - self._last_command > PING_SECONDS:
            self._command(Command.PING)
        self.lead.waiting(v, taken)
        return self.stop_requested

    def step(self) -> TrainerRow | None:
        """Train on one collection; hand v+1 to the background publication; its
        row (the publication's figures are added in the background).

        None when a stop was requested while waiting for rollouts: nothing is
        trained or recorded as consumed, so a resumed run uses those batches.
        Store outages are waited out (collection, ledger, publication) up to
        `store_outage_seconds` (`Lead.retried`); the update itself is made once.
        """
        t0 = time.monotonic()
        lead, retried = self.lead, self.lead.retried
        retried.keys()
        retried.guard()
        v = self.version
        counts = lead.collector.counts
        before = counts["batches_rejected"] + counts["groups_rejected"]
        spot = lead.spot
        spot_before = (spot.rows_checked, spot.seconds) if spot is not None else (0, 0.0)
        need = self.cfg.groups_per_step
        got = lead.collect(v, need, stop=lambda n: self._waiting(v, n))
        if len(got.groups) < need:
            return None
        figures = self._train(got.groups, v)
        retried.ledger(v + 1, got)
        # A LoRA run gathers its adapters alone: the publisher keeps the base.
        state = self._snapshot(adapters_only=self.cfg.lora_rank > 0)
        self.version = v + 1
        alive = retried.workers()
        lead.judge(v + 1, figures.gate_by_version)
        blocked = self.background.wait()
        step_seconds = time.monotonic() - t0
        lead.collector.version_gap = moving_gap(lead.collector.version_gap, step_seconds)
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
            per_worker={w: dict(c) for w, c in sorted(lead.collector.per_worker.items())},
            counts={k: int(n) for k, n in counts.items()},
            step_seconds=round(step_seconds, 3),
            wait_fraction=round(got.wait_seconds / max(step_seconds, 1e-9), 4),
            publish_blocked_seconds=round(blocked, 3),
            spot_rows=spot.rows_checked - spot_before[0] if spot is not None else 0,
            spot_seconds=round(spot.seconds - spot_before[1], 4) if spot is not None else 0.0,
            peak_mem_mb=round(peak_memory_mb(self.where.device), 1),
        )
        # The demand for v+1 is worked out in the background, against what was
        # consumed up to now: the next step may take groups meanwhile.
        consumed = set(lead.collector.consumed)
        self.background.submit(lambda: lead.publish(state, row, consumed))
        retried.heartbeat(v + 1)
        if (v + 1) % self.cfg.checkpoint_every == 0:
            retried.checkpoint(v + 1)
        return row

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
                self._run_lead()
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

    def _run_lead(self) -> None:
        self.open()
        while self.version < self.cfg.max_versions:
            if self.stop_requested:
                self.background.wait()
                self._save(self.version)
                self.checkpoints.finish()
                log.info("stopped at v%d (checkpointed; the run can resume)", self.version)
                self._command(Command.DONE)
                return
            self.step()
        self.background.wait()
        self.checkpoints.finish()
        self.lead.finish(self.version)  # done.json, then the latest.json workers poll
        self._command(Command.DONE)
        log.info("done: published v%d", self.version)
