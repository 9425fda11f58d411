"""The options of one fleet run: `FleetOptions`, read from the command's flags
(`cli.options`) and passed to the simulation, the analysis and the cost model."""

from __future__ import annotations

from dataclasses import dataclass

from colonnade.config.loading import setting


@dataclass
class FleetOptions:
    workers: int = setting(200, "simulated workers")
    versions: int = setting(50, "versions to train")
    latency_ms: float = setting(
        80.0, "round trip added to every store request (trainer and workers)"
    )
    bandwidth_mbit: float = setting(50.0, "each worker's link to the store, Mbit/s (0: unlimited)")
    churn: float = setting(0.0, "share of the fleet replaced by fresh workers at each version")
    gen_seconds: float = setting(0.5, "seconds a simulated batch's generation takes (slept)")
    groups_per_step: int = setting(16, "groups the trainer takes per version")
    groups_per_batch: int = setting(2, "groups per worker upload")
    group_size: int = setting(4, "episodes per group")
    max_lag: int = setting(2, "oldest usable policy: v - max_lag")
    anchor_every: int = setting(10, "versions between anchors")
    model: str = setting("tiny", "the trainer's model (preset or directory)")
    seed: int = setting(0, "seed of the simulated policy and of churn")
    timeout: float = setting(3600.0, "stop the trainer after this many seconds per run")

    def check(self) -> None:
        bad = [name for name, ok in (
            ("--workers >= 1", self.workers >= 1),
            ("--versions >= 2", self.versions >= 2),
            ("--latency-ms >= 0", self.latency_ms >= 0),
            ("--bandwidth-mbit >= 0", self.bandwidth_mbit >= 0),
            ("--churn in [0, 1]", 0 <= self.churn <= 1),
            ("--gen-seconds >= 0", self.gen_seconds >= 0),
            ("--groups-per-step >= 1", self.groups_per_step >= 1),
            ("--groups-per-batch >= 1", self.groups_per_batch >= 1),
            ("--group-size >= 2", self.group_size >= 2),
            ("--max-lag >= 0", self.max_lag >= 0),
            ("--anchor-every >= 1", self.anchor_every >= 1),
            ("--timeout > 0", self.timeout > 0),
        ) if not ok]  # fmt: skip
        if bad:
            raise ValueError(f"out of range: {'; '.join(bad)}")
