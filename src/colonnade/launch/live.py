"""The live view of `colonnade run`: one snapshot of the store, rendered with rich."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.table import Table

from colonnade.protocol.presence import alive, worker_heartbeats
from colonnade.store import ObjectStore
from colonnade.telemetry import read_rows

ALIVE_SECONDS = 60.0


@dataclass
class Snapshot:
    version: int = 0
    max_versions: int = 0
    last: dict = field(default_factory=dict)  # the trainer's newest row
    step_seconds: list[float] = field(default_factory=list)
    workers: dict[str, dict] = field(default_factory=dict)  # id -> heartbeat
    synced_bytes: int = 0

    @property
    def eta_s(self) -> float | None:
        recent = self.step_seconds[-5:]
        if not recent:
            return None
        return (self.max_versions - self.version) * sum(recent) / len(recent)


def snapshot(store: ObjectStore, max_versions: int) -> Snapshot:
    rows = read_rows(store, "trainer").get("trainer-main", [])
    snap = Snapshot(max_versions=max_versions)
    if rows:
        snap.last = rows[-1]
        snap.version = int(rows[-1].get("version", 0))
        snap.step_seconds = [r.get("step_seconds", 0.0) for r in rows]
    snap.workers = worker_heartbeats(store)
    # From the heartbeats already read: the metric files grow with the run and
    # would be re-read every second.
    snap.synced_bytes = sum(int(hb.get("bytes_synced", 0)) for hb in snap.workers.values())
    return snap


def render(snap: Snapshot, phase: str) -> Table:
    t = Table(title=f"colonnade run: {phase}", show_header=False, min_width=60)
    last = snap.last
    eta = snap.eta_s
    t.add_row("version", f"{snap.version} / {snap.max_versions}")
    if last:
        t.add_row("reward (train)", f"{last.get('reward_mean', 0):.3f}")
        t.add_row("pass rate (train)", f"{last.get('pass_rate', 0):.3f}")
        t.add_row("gate masked", f"{last.get('masked_fraction', 0):.4f}")
        t.add_row("trainer waiting", f"{100 * last.get('wait_fraction', 0):.0f}%")
    live = alive(snap.workers, time.time(), ALIVE_SECONDS)
    t.add_row(
        "workers alive",
        f"{len(live)}: " + ", ".join(f"{w}@v{hb.get('version')}" for w, hb in sorted(live.items())),
    )
    t.add_row("bytes synced", f"{snap.synced_bytes / 1e6:.2f} MB")
    t.add_row("ETA", "-" if eta is None else f"{eta:.0f} s")
    return t


def log_line(snap: Snapshot) -> str:
    """The same facts on one line, for --no-live and non-terminal output."""
    last = snap.last
    return (
        f"v{snap.version}/{snap.max_versions} reward {last.get('reward_mean', 0):.3f} "
        f"pass {last.get('pass_rate', 0):.3f} masked {last.get('masked_fraction', 0):.4f} "
        f"workers {len(snap.workers)} synced {snap.synced_bytes / 1e6:.2f} MB"
    )
