"""The live view of `colonnade run`: one snapshot of the store, rendered with rich."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.table import Table

from colonnade.envs import Metric
from colonnade.protocol.documents import WorkerHeartbeat
from colonnade.protocol.metrics import TrainerRow
from colonnade.protocol.presence import alive, worker_heartbeats
from colonnade.protocol.reader import open_run
from colonnade.protocol.schemas import SchemaError
from colonnade.store import NotFound, ObjectStore
from colonnade.telemetry import read_trainer_rows

ALIVE_SECONDS = 60.0


@dataclass
class Snapshot:
    version: int = 0
    max_versions: int = 0
    last: TrainerRow | None = None  # the trainer's newest row
    step_seconds: list[float] = field(default_factory=list)
    workers: dict[str, WorkerHeartbeat] = field(default_factory=dict)  # id -> heartbeat
    synced_bytes: int = 0
    metrics: tuple[Metric, ...] = ()  # what the environment declares (`metrics_of`)

    def declared(self) -> list[tuple[str, float]]:
        """(label, value) of each declared metric the newest row carries."""
        got = self.last.env_metrics if self.last is not None else {}
        return [(m.title, got[m.name]) for m in self.metrics if m.name in got]

    @property
    def eta_s(self) -> float | None:
        recent = self.step_seconds[-5:]
        if not recent:
            return None
        return (self.max_versions - self.version) * sum(recent) / len(recent)


def snapshot(store: ObjectStore, max_versions: int, metrics: tuple[Metric, ...] = ()) -> Snapshot:
    """The store now; `metrics`: the environment's declared metrics, shown beside pass rate."""
    snap = Snapshot(max_versions=max_versions, metrics=tuple(metrics))
    try:
        view = open_run(store)
    except (NotFound, SchemaError):
        return snap  # no run yet (or not one the trainer signed)
    rows = read_trainer_rows(store, view.trust)
    if rows:
        snap.last = rows[-1]
        snap.version = rows[-1].version
        snap.step_seconds = [r.step_seconds for r in rows]
    snap.workers = worker_heartbeats(view.inbox)
    # From the heartbeats already read: the metric files grow with the run and
    # would be re-read every second.
    snap.synced_bytes = sum(hb.bytes_synced for hb in snap.workers.values())
    return snap


def render(snap: Snapshot, phase: str) -> Table:
    t = Table(title=f"colonnade run: {phase}", show_header=False, min_width=60)
    last = snap.last
    eta = snap.eta_s
    t.add_row("version", f"{snap.version} / {snap.max_versions}")
    if last is not None:
        t.add_row("reward (train)", f"{last.reward_mean:.3f}")
        t.add_row("pass rate (train)", f"{last.pass_rate:.3f}")
        for label, value in snap.declared():
            t.add_row(f"{label} (train)", f"{value:.3f}")
        t.add_row("gate masked", f"{last.masked_fraction:.4f}")
        t.add_row("trainer waiting", f"{100 * last.wait_fraction:.0f}%")
    live = alive(snap.workers, time.time(), ALIVE_SECONDS)
    t.add_row(
        "workers alive",
        f"{len(live)}: " + ", ".join(f"{w}@v{hb.version}" for w, hb in sorted(live.items())),
    )
    t.add_row("bytes synced", f"{snap.synced_bytes / 1e6:.2f} MB")
    t.add_row("ETA", "-" if eta is None else f"{eta:.0f} s")
    return t


def log_line(snap: Snapshot) -> str:
    """The same facts on one line, for --no-live and non-terminal output."""
    last = snap.last or TrainerRow(time=0.0, version=0)  # zeros before the first row
    declared = "".join(f"{label} {value:.3f} " for label, value in snap.declared())
    return (
        f"v{snap.version}/{snap.max_versions} reward {last.reward_mean:.3f} "
        f"pass {last.pass_rate:.3f} {declared}masked {last.masked_fraction:.4f} "
        f"workers {len(snap.workers)} synced {snap.synced_bytes / 1e6:.2f} MB"
    )
