"""`colonnade run`'s settings: the run's own, plus [trainer] and [worker] tables.

The tables override the trainer preset the run preset names and the worker
defaults, key by key (resolved in `launch.config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from .loading import setting
from .names import check_env, check_model


@dataclass
class RunConfig:
    preset: str = setting("demo", "named run settings (config/presets.py)")
    env: str = setting("searchqa", "environment name or import path")
    model: str = setting("tiny", "preset (tiny, smollm2-135m), model directory or hub name")
    out: str = setting("", "run directory (default runs/<timestamp>)")
    store: str = setting("", "run prefix (default <out>/store); s3://bucket/prefix too")
    endpoint_url: str | None = setting(None, "S3 endpoint (R2, MinIO, SeaweedFS)")
    workers: int = setting(2, "rollout worker processes")
    stages: int = setting(
        0,
        "0: each worker holds the whole model; 2 or more: the workers run as pipeline groups "
        "of this many stage-workers each (`worker --stage K/N`), workers a multiple of it",
    )
    threads: int = setting(1, "torch threads per process")
    trainer_ranks: int = setting(
        1,
        "trainer processes; from 2 up the trainer runs under torchrun with FSDP2 (one per "
        "GPU on CUDA, gloo on the CPU)",
    )
    warmstart: bool = setting(True, "a supervised warm start before RL (cached per model and task)")
    warmstart_steps: int | None = setting(None, "warm-start steps (unset: the model's default)")
    warmstart_drill_steps: int | None = setting(
        None, "copy-drill steps before the warm start (unset: per model and task)"
    )
    good_fraction: float | None = setting(
        None, "share of demonstrations that succeed (unset: per model and task)"
    )
    eval_n: int = setting(200, "held-out tasks evaluated before and after (0: none)")
    eval_batch: int = setting(50, "episodes per eval batch")
    eval_every: int = setting(
        0,
        "while training, evaluate the newest version on eval_during_n held-out tasks every "
        "this many versions, for the report's learning curve (0: never); it runs beside the "
        "trainer and workers, on the same cores",
    )
    eval_during_n: int = setting(50, "held-out tasks of each eval while training")
    eval_temperature: float = setting(1.0, "sampling temperature of the held-out evals")
    metrics_port: int | None = setting(
        None, "trainer's Prometheus port; worker i gets port + 1 + i"
    )
    metrics_host: str = setting(
        "127.0.0.1", "the address the trainer's and workers' Prometheus endpoints bind"
    )
    max_minutes: float | None = setting(
        None,
        "wall-clock budget from the start: when spent, the trainer stops after the version "
        "in flight and the final model is still exported, evaluated and reported",
    )
    live: bool = setting(True, "the live view (off: one log line per version)")
    sign: bool = setting(True, "a key pair per worker under <out>/keys; the trainer requires them")
    trainer: dict = setting({}, "TrainerConfig overrides ([trainer] table, --trainer.* flags)")
    worker: dict = setting({}, "WorkerConfig overrides ([worker] table, --worker.* flags)")

    def check(self) -> None:
        """Settings no run can start with: a ValueError naming them."""
        check_env(self.env)
        check_model(self.model)
        if min(self.workers, self.eval_n, self.eval_every, self.eval_during_n) < 0:
            raise ValueError("workers, eval_n, eval_every and eval_during_n must be >= 0")
        if self.stages == 1 or self.stages < 0 or (self.stages and self.workers % self.stages):
            raise ValueError("stages must be 0, or 2 or more with workers a multiple of it")
        if self.threads < 1 or self.eval_batch < 1:
            raise ValueError("threads and eval_batch must be >= 1")
        if self.trainer_ranks < 1:
            raise ValueError("trainer_ranks must be >= 1")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError("max_minutes must be > 0")
