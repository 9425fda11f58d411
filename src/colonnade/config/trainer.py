"""The trainer's settings (`colonnade trainer`, `[trainer]` in run.toml).

Light on purpose: reading or checking a config imports neither torch nor
transformers. Every field's help is its `--flag`'s help (`config.flags`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from colonnade.choices import HASHES, LORA_TARGETS, PUBLISHED_PRECISIONS

from .loading import setting
from .names import check_env, check_model

DTYPES = ("auto", "bf16", "fp32")
DEVICES = ("auto", "cuda", "mps", "cpu")


@dataclass
class TrainerConfig:
    TABLE: ClassVar[str] = "trainer"  # its table in a run file

    store: str = setting("", "run prefix: a directory, file:///dir or s3://bucket/prefix")
    endpoint_url: str | None = setting(None, "S3 endpoint (R2, MinIO, SeaweedFS); default AWS")
    profile: str | None = setting(None, "credentials profile for the run's store (s3://)")
    inbox: str = setting(
        "",
        "where workers write (a second bucket: s3://inbox-bucket/prefix); default the inbox/ "
        "folder of the run's store. Recorded in the signed run.json",
    )
    inbox_endpoint_url: str | None = setting(
        None, "the inbox's S3 endpoint when it differs from the run's (recorded for workers)"
    )
    inbox_profile: str | None = setting(None, "credentials profile for the inbox (s3://)")
    key: str = setting(
        "",
        "the trainer's private key (`colonnade keys new --id trainer`); it signs everything "
        "workers act on. Default: one kept in the local cache, made at the first start",
    )
    env: str = setting("smoke", "environment name or import path")
    env_kwargs: dict = setting({}, "the environment's arguments (flags: --env-arg k=v)")
    model: str = setting("tiny", "preset (tiny, smollm2-135m), model directory or hub name")
    precision: str = setting(
        "int8", "of the published weights: what workers run", PUBLISHED_PRECISIONS
    )
    hash: str = setting(
        "blake3", "of published states and payloads (sha256 where required)", HASHES
    )
    device: str = setting(
        "auto",
        "where the trainer computes (auto: CUDA, then MPS, then CPU); under torchrun each "
        "rank takes the GPU of its local rank",
        DEVICES,
    )
    dtype: str = setting(
        "auto",
        "compute precision (auto: bf16 on CUDA, fp32 elsewhere); bf16 keeps fp32 master "
        "weights and Adam states",
        DTYPES,
    )
    grad_ckpt: bool | None = setting(
        None, "activation checkpointing of every decoder layer (unset: on for CUDA)"
    )
    fsdp: bool = setting(
        False,
        "FSDP2 on a single process too: bf16 copies of one layer at a time instead of the "
        "whole model (always on under torchrun with 2+ ranks)",
    )
    cpu_offload: bool = setting(
        False,
        "FSDP2's CPU offload: parameters, gradients and optimizer states in host memory, "
        "moved to the GPU a layer at a time (CUDA only; implies fsdp): full fine-tuning of a "
        "model whose states do not fit the GPU",
    )
    lora_rank: int = setting(
        0,
        "LoRA: train rank-R adapters on a frozen base instead of every weight (0: full "
        "fine-tuning); the base is published once, each version's patch carries the adapters",
    )
    lora_alpha: float = setting(0.0, "LoRA: the adapters' alpha (scale alpha/rank; 0: 2 x rank)")
    lora_targets: str = setting(
        ",".join(LORA_TARGETS), "LoRA: the linears adapted (last name parts, comma-separated)"
    )
    lora_lr: float = setting(
        0.0,
        "LoRA: the adapters' AdamW rate (0: 10 x lr, about the ratio LoRA's best rate keeps "
        "to full fine-tuning's)",
    )
    max_versions: int = setting(20, "stop once this version is published")
    max_lag: int = setting(2, "oldest usable rollout: v - max_lag (0: synchronous on-policy)")
    anchor_every: int = setting(10, "versions between full anchors (K)")
    group_size: int = setting(8, "episodes per task (G)")
    groups_per_step: int = setting(8, "groups per optimizer step")
    groups_per_batch: int = setting(2, "groups per worker upload")
    # Beyond what the next steps take, so that one worker slow to deliver a
    # claimed batch does not hold the trainer; what is not taken shrinks the
    # next version's demand rather than being wasted.
    surplus_groups: int = setting(
        2, "groups the fleet may make beyond what the trainer's next steps will take"
    )
    claim_seconds: float = setting(
        120.0,
        "the base claim lease: a worker's claim on a batch lapses after its lease without the "
        "batch, and another worker may make it (a restarted worker's claims lapse at once); a "
        "worker's lease follows its speed, 3x its slowest recent claim-to-batch time, within "
        "1x to 20x this",
    )
    lr: float = setting(1e-5, "AdamW learning rate")
    # Adam's first updates move every weight by about the full rate: a smoke
    # run without warm-up collapsed within a few versions (docs/benchmarks.md).
    warmup_versions: int = setting(10, "linear warm-up of the rate over the first versions")
    weight_decay: float = setting(0.0, "AdamW weight decay")
    temperature: float = setting(1.0, "workers' sampling temperature")
    max_turn_tokens: int = setting(96, "model tokens per turn")
    max_episode_tokens: int = setting(
        512, "tokens of an episode after its prompt: model turns and tool replies"
    )
    delta_low: float = setting(0.15, "DPPO gate: largest drop of a token's probability kept")
    delta_high: float = setting(0.15, "DPPO gate: largest rise of a token's probability kept")
    ratio_clip: float = setting(2.0, "clamp of the importance ratio of kept tokens")
    max_grad_norm: float = setting(1.0, "clip of the gradient's global norm")
    forward_as_published: bool = setting(
        False,
        "the step's forward and backward run on the weights as workers receive them (int8 "
        "or bf16), the update going to the fp32 masters: the gate then sees staleness only, "
        "not the part of the update below the published precision",
    )
    scale_by_std: bool = setting(False, "divide advantages by the group's reward std")
    micro_tokens: int = setting(8192, "padded tokens (rows x longest) per micro-batch")
    logit_chunk_tokens: int = setting(4096, "row-positions whose fp32 logits exist at once")
    checkpoint_every: int = setting(5, "versions between checkpoints")
    keep_checkpoints: int = setting(2, "complete checkpoints kept (older ones are deleted)")
    retain_all: bool = setting(
        False,
        "keep every rollout, ledger and version (for audits); by default what no step or "
        "joiner can use any more is deleted",
    )
    staging_dir: str = setting("", "local folder for checkpoint shards (default <cache>/staging)")
    multipart_mb: int = setting(64, "store objects from this size (MB) up go multipart / ranged")
    poll_seconds: float = setting(1.0, "the longest wait between polls of the store")
    resume: bool = setting(True, "continue a run found under the prefix")
    takeover: bool = setting(
        False, "resume even if another trainer's heartbeat is fresh (it is dead)"
    )
    heartbeat_timeout: float = setting(60.0, "seconds after which a silent worker counts as gone")
    forget_workers_seconds: float = setting(
        3600.0,
        "retention deletes the heartbeat of a worker silent this long (its metrics stay; "
        "it writes a new one if it comes back)",
    )
    metrics_port: int | None = setting(
        None,
        "serve Prometheus metrics on metrics_host:PORT (0: any free port), every worker's "
        "figures included (read from their metric rows in the inbox)",
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "the address the Prometheus endpoint binds (0.0.0.0: every interface; it has no "
        "authentication)",
    )
    store_outage_seconds: float = setting(900.0, "keep retrying an unavailable store this long")
    # Re-read every step, so workers can be added mid-run.
    worker_keys: str = setting(
        "",
        "registered workers' public keys: a .pub file or a directory of them; batches must "
        "then be signed (unset: unsigned batches are taken)",
    )
    trusted_keys: str = setting(
        "",
        "workers whose rewards are taken where the trainer cannot recompute them (an environment "
        "that runs its own loop, vf:NAME): a .pub file or a directory of them, each registered "
        "in worker_keys too (unset: no worker's)",
    )
    quarantine_factor: float = setting(
        5.0, "quarantine a worker past this many times the fleet's median mismatch (0: never)"
    )
    quarantine_min_tokens: int = setting(400, "tokens seen of a worker before it can be judged")
    # Each checked row costs one teacher-forced pass of the published model on
    # the trainer's CPU; the default keeps that within a tenth of a smoke step
    # (docs/benchmarks.md, "Proven sampling").
    spot_rate: float = setting(
        0.05,
        "share of rows whose sampling distribution the trainer recomputes on the published "
        "weights of their version (spot checks; 0: off): a forged row it checks rejects its "
        "batch and quarantines the worker",
    )
    # Honest engines differ by rounding, more on deeper models: the defaults
    # stand well above the gaps measured on SmolLM2-135M (docs/benchmarks.md);
    # a run of a model measured to differ less can lower them and catch more.
    spot_logp_tolerance: float = setting(
        0.3, "spot checks: a row's largest honest mean |reported - recomputed log-prob| (nats)"
    )
    spot_interval_tolerance: float = setting(
        0.2,
        "spot checks: a token's largest honest gap between its reported interval "
        "[below, below + prob] and the recomputed one",
    )
    seed: int = setting(0, "seed of task choice and initialisation")

    @property
    def lora_target_names(self) -> tuple[str, ...]:
        return tuple(t.strip() for t in self.lora_targets.split(",") if t.strip())

    @property
    def rate(self) -> float:
        """The AdamW rate in effect: `lr`, or a LoRA run's adapter rate."""
        if not self.lora_rank:
            return self.lr
        return self.lora_lr or 10.0 * self.lr

    @property
    def lora_scale_alpha(self) -> float:
        """The alpha in effect (0 means twice the rank)."""
        return self.lora_alpha or 2.0 * self.lora_rank

    def check(self) -> None:
        """Settings no step can run with: a ValueError naming them."""
        check_env(self.env)
        check_model(self.model)
        if self.hash not in HASHES:
            raise ValueError(f"hash {self.hash!r}: choose one of {', '.join(HASHES)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if min(self.micro_tokens, self.logit_chunk_tokens, self.checkpoint_every) < 1:
            raise ValueError("micro_tokens, logit_chunk_tokens and checkpoint_every must be >= 1")
        if self.multipart_mb < 5:
            raise ValueError("multipart_mb must be >= 5 (S3's smallest part)")
        if self.trusted_keys and not self.worker_keys:
            raise ValueError("trusted_keys needs worker_keys: a worker is trusted by its signature")
        bad = [name for name, ok in _ranges(self) if not ok]
        if bad:
            raise ValueError(f"out of range: {'; '.join(bad)}")


def _ranges(c: TrainerConfig) -> list[tuple[str, bool]]:
    """(setting and its allowed range, whether it holds): checked when the
    config is built, so a bad value fails at once and not later in a worker."""
    return [
        ("lora_rank >= 0", c.lora_rank >= 0),
        ("lora_alpha >= 0", c.lora_alpha >= 0),
        ("lora_lr >= 0", c.lora_lr >= 0),
        ("lora_targets names at least one module", bool(c.lora_target_names)),
        ("max_versions >= 1", c.max_versions >= 1),
        ("max_lag >= 0", c.max_lag >= 0),
        ("anchor_every >= 1", c.anchor_every >= 1),
        ("group_size >= 2", c.group_size >= 2),
        ("groups_per_step >= 1", c.groups_per_step >= 1),
        ("groups_per_batch >= 1", c.groups_per_batch >= 1),
        ("surplus_groups >= 0", c.surplus_groups >= 0),
        ("claim_seconds > 0", c.claim_seconds > 0),
        ("lr > 0", c.lr > 0),
        ("warmup_versions >= 0", c.warmup_versions >= 0),
        ("weight_decay >= 0", c.weight_decay >= 0),
        ("temperature > 0", c.temperature > 0),
        ("max_turn_tokens >= 1", c.max_turn_tokens >= 1),
        ("max_episode_tokens >= max_turn_tokens", c.max_episode_tokens >= c.max_turn_tokens),
        ("delta_low > 0", c.delta_low > 0),
        ("delta_high > 0", c.delta_high > 0),
        ("ratio_clip >= 1", c.ratio_clip >= 1),
        ("max_grad_norm > 0", c.max_grad_norm > 0),
        ("keep_checkpoints >= 1", c.keep_checkpoints >= 1),
        ("poll_seconds > 0", c.poll_seconds > 0),
        ("heartbeat_timeout > 0", c.heartbeat_timeout > 0),
        (
            "forget_workers_seconds > heartbeat_timeout",
            c.forget_workers_seconds > c.heartbeat_timeout,
        ),
        ("store_outage_seconds >= 0", c.store_outage_seconds >= 0),
        ("quarantine_factor >= 0", c.quarantine_factor >= 0),
        ("quarantine_min_tokens >= 0", c.quarantine_min_tokens >= 0),
        ("0 <= spot_rate <= 1", 0 <= c.spot_rate <= 1),
        ("spot_logp_tolerance > 0", c.spot_logp_tolerance > 0),
        ("spot_interval_tolerance > 0", c.spot_interval_tolerance > 0),
    ]
