"""A rollout worker's settings (`colonnade worker`, `[worker]` in run.toml).

Everything else a worker needs (environment, sampling, group size,
precision) comes from the run's run.json, written by the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from colonnade.choices import ENGINE_CHOICES

from .loading import setting

DEVICES = ("auto", "cpu", "cuda", "mps")


@dataclass
class WorkerConfig:
    TABLE: ClassVar[str] = "worker"  # its table in a run file

    store: str = setting("", "run prefix: a directory, file:///dir or s3://bucket/prefix")
    join: str = setting(
        "",
        "a join string from `colonnade invite` (colonnade1:…): sets the store, its endpoint "
        "and the trainer's key to pin; credentials still come from this machine",
    )
    endpoint_url: str | None = setting(None, "S3 endpoint (R2, MinIO, SeaweedFS); default AWS")
    profile: str | None = setting(None, "credentials profile for the run's store (read only)")
    inbox_profile: str | None = setting(
        None, "credentials profile for the inbox, where the worker writes (default: --profile)"
    )
    trust: str = setting(
        "",
        "the trainer's key: its .pub/.key file or fingerprint (SHA256:...); unset, the key "
        "of the first run.json read is pinned (one warning)",
    )
    id: str = setting("", "the worker's name in the run (default: host-pid)")
    device: str = setting("cpu", "where the torch engine runs", DEVICES)
    engine: str = setting(
        "auto",
        "rollout engine (auto: MLX on Apple silicon when installed, else torch)",
        ENGINE_CHOICES,
    )
    max_batches: int = setting(0, "stop after this many uploads (0: until the run is done)")
    poll_seconds: float = setting(
        1.0, "the longest wait between polls of the store before the version interval is known"
    )
    join_timeout: float = setting(600.0, "how long to wait for the run's run.json")
    metrics_port: int | None = setting(
        None, "serve Prometheus metrics on metrics_host:PORT (0: any free port)"
    )
    metrics_host: str = setting(
        "127.0.0.1",
        "the address the Prometheus endpoint binds (0.0.0.0: every interface; it has no "
        "authentication)",
    )
    key: str = setting("", "private key file from `colonnade keys new` (signs batches)")
    threads: int = setting(
        0,
        "torch's intra-op threads, which the engine computes with (0: torch's default, one "
        "per core or OMP_NUM_THREADS); MLX has no such setting",
    )

    def check(self) -> None:
        """Settings no worker can run with: a ValueError naming them."""
        if self.engine not in ENGINE_CHOICES:
            raise ValueError(f"engine {self.engine!r}: choose one of {', '.join(ENGINE_CHOICES)}")
        if self.max_batches < 0 or self.poll_seconds <= 0:
            raise ValueError("max_batches must be >= 0 and poll_seconds > 0")
        if self.join_timeout <= 0:
            raise ValueError("join_timeout must be > 0")
        if self.threads < 0:
            raise ValueError("threads must be >= 0")
