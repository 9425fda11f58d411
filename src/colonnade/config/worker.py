"""A rollout worker's settings (`colonnade worker`, `[worker]` in run.toml).

Everything else a worker needs (environment, sampling, group size,
precision) comes from the run's run.json, written by the trainer.

A model bigger than one worker runs as a pipeline group: N workers, each
started with `stage` K/N and the same `stage_group`, the group's worker ids
in stage order (docs/operating.md). Every stage of a group is told the
whole group, so each knows whom it reads from and writes for, and a stage
started with another list is refused by the others (the list names the
group in every message).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from colonnade.choices import ENGINE_CHOICES
from colonnade.untrusted import host_port

from .loading import setting

DEVICES = ("auto", "cpu", "cuda", "mps")
STAGE_LINKS = ("store", "tcp")


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
    stage: str = setting(
        "",
        "this worker's stage of a pipeline group, K/N (stage K of N, from 1): it holds about "
        "1/N of the model's layers; stage 1 claims and uploads the group's batches (unset: "
        "the whole model)",
    )
    stage_group: str = setting(
        "",
        "the pipeline group's worker ids in stage order, comma separated; this worker's --id "
        "is the K-th, and every stage of the group is started with the same list",
    )
    stage_in_flight: int = setting(
        2, "micro-batches a pipeline's first stage keeps in flight, so the stages work at once"
    )
    stage_timeout: float = setting(
        120.0,
        "seconds a pipeline's first stage waits for the last stage's reply before it gives "
        "the batch up (a stage that died)",
    )
    stage_link: str = setting(
        "store",
        "how a pipeline's stage messages travel: through the run's inbox (store), or pushed "
        "over TCP straight to the next stage (tcp: every stage of the group must reach the "
        "next one's --stage-advertise address; rollout/stagelink.py)",
        STAGE_LINKS,
    )
    stage_listen: str = setting(
        "0.0.0.0:0",
        "HOST:PORT a stage on a tcp link takes its messages at (port 0: any free one)",
    )
    stage_advertise: str = setting(
        "",
        "HOST:PORT the stage before this one dials, published in the inbox (default: the "
        "--stage-listen address, this host's name resolved for 0.0.0.0, the port bound)",
    )
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
        if self.stage_link not in STAGE_LINKS:
            raise ValueError(f"stage_link {self.stage_link!r}: choose one of store, tcp")
        try:
            host_port(self.stage_listen, any_port=True)
        except ValueError as e:
            raise ValueError(f"--stage-listen {e}") from None
        if self.stage_advertise:
            try:
                host_port(self.stage_advertise)
            except ValueError as e:
                raise ValueError(f"--stage-advertise {e}") from None
        if self.stage or self.stage_group:
            self.pipeline()

    def pipeline(self) -> tuple[int, tuple[str, ...]] | None:
        """(this worker's stage from 0, the group's ids in stage order), or
        None for a whole-model worker; a ValueError for a group no stage can
        run in."""
        if not (self.stage or self.stage_group):
            return None
        if not (self.stage and self.stage_group):
            raise ValueError("a pipeline stage takes both --stage K/N and --stage-group ID1,...")
        k, n = parse_stage(self.stage)
        ids = tuple(w.strip() for w in self.stage_group.split(","))
        if n < 2:
            raise ValueError(f"--stage {self.stage}: a pipeline has 2 stages or more")
        if len(ids) != n or not all(ids):
            raise ValueError(
                f"--stage-group names {len(ids)} worker(s) for {n} stages: one id a stage"
            )
        if len(set(ids)) != n:
            raise ValueError("--stage-group names a worker twice")
        if self.id and self.id != ids[k]:
            raise ValueError(f"--id {self.id!r} but stage {k + 1} of --stage-group is {ids[k]!r}")
        if self.engine == "mlx":
            raise ValueError("pipeline stages run on the torch engine, not mlx")
        if self.stage_in_flight < 1 or not self.stage_timeout > 0:
            raise ValueError("stage_in_flight must be >= 1 and stage_timeout > 0")
        return k, ids


def parse_stage(text: str) -> tuple[int, int]:
    """(index from 0, count) of a `K/N` stage name, K counted from 1."""
    k, sep, n = text.partition("/")
    if not sep or not k.strip().isdigit() or not n.strip().isdigit():
        raise ValueError(f"a stage is K/N (stage K of N, from 1), not {text!r}")
    k_, n_ = int(k), int(n)
    if not 1 <= k_ <= n_:
        raise ValueError(f"stage {text!r}: K must be 1 .. N")
    return k_ - 1, n_
