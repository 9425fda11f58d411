"""What a fleet run's counters say: one row per version, the run's summary,
and the verdict against `TARGETS`.

Called by `cli.run` on the `RunResult` of `simulation.run_fleet`. Every
figure is a difference of the `Tally` snapshots taken when versions were
published; the steady state starts at `warmup`.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .options import FleetOptions
from .simulation import WORKER_PREFIX, Mark, RunResult
from .wan import VERBS

if TYPE_CHECKING:
    from colonnade.protocol.metrics import TrainerRow

# What the store protocol should hold to at fleet scale (`verdict`).
TARGETS = {"follower_anchor_downloads": 0, "requests_per_worker_per_version": 5.0,
           "waste_fraction": 0.10}  # fmt: skip


def warmup(opts: FleetOptions) -> int:
    """The version from which the store should be flat: retention keeps the
    newest anchor's window and the one before it (and max_lag of rollouts),
    so the count repeats from two anchor windows on; half the run if shorter."""
    return min(2 * opts.anchor_every + opts.max_lag, opts.versions // 2)


def _workers(counter: dict) -> dict:
    return {c: n for c, n in counter.items() if c.startswith(WORKER_PREFIX)}


def _verbs(snap: dict) -> Counter:
    out: Counter = Counter()
    for n in _workers(snap["requests"]).values():
        out.update(n)
    return out


def _follower_anchors(snap: dict) -> int:
    return sum(max(0, n - 1) for n in _workers(snap["anchors"]).values())


def _down(snap: dict) -> int:
    return sum(_workers(snap["down"]).values())


def trained_by_source(rows: list[TrainerRow]) -> Counter:
    """Groups trained on per policy version that made them (a row of version
    V trained on groups of V - 1 - lag)."""
    out: Counter = Counter()
    for r in rows:
        for lag, n in r.staleness.items():
            out[r.version - 1 - int(lag)] += n
    return out


def per_version(res: RunResult) -> list[dict]:
    """One row per published version v >= 1: the fleet's requests and bytes
    between v-1 and v, per worker; the groups made with v's policy and
    trained on; the trainer's step making v; the store after v."""
    rows = {r.version: r for r in res.rows}
    trained = trained_by_source(res.rows)
    final = res.tally.snapshot()
    n = res.opts.workers
    out = []
    for prev, m in zip(res.marks, res.marks[1:], strict=False):
        verbs = _verbs(m.tally) - _verbs(prev.tally)
        made = final["uploads"][m.version] * res.opts.groups_per_batch
        r = rows.get(m.version)
        out.append({
            "version": m.version,
            "workers": m.live,
            "left": m.left,
            "joined": m.joined,
            "requests_per_worker": round(sum(verbs.values()) / n, 2),
            "by_verb": {v: round(verbs[v] / n, 2) for v in VERBS if verbs[v]},
            "down_per_worker": round((_down(m.tally) - _down(prev.tally)) / n),
            "follower_anchor_downloads": _follower_anchors(m.tally) - _follower_anchors(prev.tally),
            "groups_made": made,
            "groups_trained": trained[m.version],
            "trainer_wait_s": r.wait_seconds if r else None,
            "trainer_step_s": r.step_seconds if r else None,
            "objects": sum(m.objects.values()),
            "store_bytes": m.bytes,
        })  # fmt: skip
    return out


def _ratio(a: float, b: float) -> float:
    return round(a / b, 4) if b else 0.0


def summarize(res: RunResult) -> dict:
    """The totals and the steady-state figures of one run."""
    o, marks = res.opts, res.marks
    warm = min(warmup(o), len(marks) - 2)
    at = {m.version: m for m in marks}
    first, last = at.get(warm, marks[0]), marks[-1]
    span = max(1, last.version - first.version) * o.workers
    verbs = _verbs(last.tally) - _verbs(first.tally)
    trainer_verbs = Counter(last.tally["requests"].get("trainer", {}))
    trainer_verbs.subtract(first.tally["requests"].get("trainer", {}))
    final = res.tally.snapshot()
    made = sum(final["uploads"].values()) * o.groups_per_batch
    trained = trained_by_source(res.rows)
    closed = last.version - 1 - o.max_lag  # the newest version whose window closed in the run
    made_closed = sum(n for v, n in final["uploads"].items() if v <= closed) * o.groups_per_batch
    trained_closed = sum(n for v, n in trained.items() if v <= closed)
    steady_rows = res.rows[1:]  # the first step waits for the fleet to start
    objects = [sum(m.objects.values()) for m in marks if m.version >= warm]
    window = [_versioned(m) for m in marks if warm <= m.version < warm + o.anchor_every]
    later = [_versioned(m) for m in marks if m.version >= warm + o.anchor_every]
    patch = [r.patch_bytes for r in res.rows if r.patch_bytes]
    return {
        "workers": o.workers,
        "versions": last.version,
        "seconds": round(res.seconds, 1),
        "warmup_versions": warm,
        "follower_anchor_downloads": res.follower_anchors,
        "requests_per_worker_per_version": _ratio(sum(verbs.values()), span),
        "requests_per_worker_per_version_by_verb": {
            v: _ratio(verbs[v], span) for v in VERBS if verbs[v]
        },
        "trainer_requests_per_version_by_verb": {
            v: _ratio(trainer_verbs[v], max(1, last.version - first.version))
            for v in VERBS
            if trainer_verbs[v] > 0
        },
        # The polls among the gets: what pacing (polling.py) decides.
        "latest_polls_per_worker_per_version": _ratio(
            sum(_workers(last.tally["polls"]).values())
            - sum(_workers(first.tally["polls"]).values()),
            span,
        ),
        "down_bytes_per_worker_per_version": round((_down(last.tally) - _down(first.tally)) / span),
        "down_bytes_per_worker": round(_down(final) / max(1, len(_workers(final["down"])))),
        "groups_uploaded": made,
        "groups_trained": sum(trained.values()),
        "waste_fraction": round(max(0.0, 1 - sum(trained.values()) / made), 4) if made else 0.0,
        "waste_fraction_closed_windows": (
            round(max(0.0, 1 - trained_closed / made_closed), 4) if made_closed else 0.0
        ),
        "trainer_wait_fraction": _wait(steady_rows),
        "trainer_wait_fraction_all": _wait(res.rows),
        "objects_after_warmup": objects[0] if objects else 0,
        "objects_peak": max(objects, default=0),
        "objects_end": sum(last.objects.values()),
        "objects_end_by_prefix": dict(sorted(last.objects.items())),
        # Without the per-worker documents (a heartbeat and metric segments per
        # worker that ever made a batch: bounded by the fleet, not the versions).
        "versioned_objects_first_window_peak": max(window, default=0),
        "versioned_objects_later_peak": max(later, default=0),
        "per_worker_objects_end": sum(last.objects.values()) - _versioned(last),
        "store_bytes_end": last.bytes,
        "patch_bytes_mean": round(sum(patch) / len(patch)) if patch else 0,
        "full_bytes": res.rows[-1].full_bytes if res.rows else 0,
        "joiner_bytes": res.joiner["bytes"],
        "joiner_weight_bytes": res.joiner["weight_bytes"],
        "joiner_seconds": res.joiner["seconds"],
        "joiner": res.joiner,
        "worker_errors": len(res.errors),
        **res.extra,
        "stopped_early": res.stopped_early,
    }


PER_WORKER = ("workers", "metrics")  # top-level prefixes of per-process documents


def _versioned(m: Mark) -> int:
    return sum(n for prefix, n in m.objects.items() if prefix not in PER_WORKER)


def _wait(rows: list[TrainerRow]) -> float:
    step = sum(r.step_seconds for r in rows)
    return round(sum(r.wait_seconds for r in rows) / step, 4) if step else 0.0


def joiner_bound(s: dict, anchor_every: int) -> dict:
    """What a joiner downloads at any version, e.g. v1,000: the newest anchor
    and at most K - 1 patches (the worst case is the version before an anchor)."""
    anchor, patch = s["full_bytes"], s["patch_bytes_mean"]
    return {
        "anchor_plus_patches_worst_bytes": anchor + (anchor_every - 1) * patch,
        "at_version_1000_bytes": anchor + (1000 % anchor_every) * patch,
    }


def verdict(s: dict) -> dict:
    """Each target: met or not."""
    t = TARGETS
    out = {
        "follower_anchor_downloads_0": s["follower_anchor_downloads"]
        == t["follower_anchor_downloads"],
        "requests_per_worker_per_version_le_5": s["requests_per_worker_per_version"]
        <= t["requests_per_worker_per_version"],
        "waste_le_10pct": s["waste_fraction"] <= t["waste_fraction"],
        # No growth from one anchor window to the next (10% for the rollouts in
        # flight), per-worker documents aside.
        "objects_flat_after_warmup": s["versioned_objects_later_peak"]
        <= 1.1 * s["versioned_objects_first_window_peak"],
    }
    if "baseline" in s:
        out["trainer_wait_no_worse_than_baseline"] = (
            s["trainer_wait_fraction"] <= s["baseline"]["trainer_wait_fraction"]
        )
    return out
