"""report.json: the figures of a run, from what the store holds.

Sources: run.json, every version's meta.json, the trainer's and workers'
metric rows, the worker heartbeats, and the launcher's facts and evals
under `report/` when `colonnade run` made the run. A run started by hand
(trainer and workers on separate machines) has no launcher facts: its
report leaves eval out and takes wall time from the trainer's rows.

Units: a "rollout" is one uploaded batch object (groups × episodes); the
episode counts are given beside.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter

from colonnade.protocol import RunSpec, keys, read_meta
from colonnade.protocol.presence import worker_heartbeats
from colonnade.protocol.schemas import MAX_JSON_BYTES
from colonnade.store import NotFound, ObjectStore
from colonnade.telemetry import read_rows
from colonnade.train.quarantine import accumulate, figures


def _json(store: ObjectStore, key: str):
    try:
        return json.loads(store.get(key, max_bytes=MAX_JSON_BYTES))
    except (NotFound, ValueError):
        return None


def read_launch(store: ObjectStore) -> dict | None:
    return _json(store, keys.LAUNCH)


def _versions(store: ObjectStore) -> list[dict]:
    """The versions still in the store (retention deletes old ones)."""
    found = sorted(int(k.split("/")[1]) for k in store.list("weights/") if k.endswith("/meta.json"))
    out = []
    for v in found:
        meta = read_meta(store, v)
        if meta is not None:
            out.append(
                {
                    "version": v,
                    "kind": meta.kind,
                    "bytes": meta.anchor_bytes or meta.patch_bytes,
                    "patch_bytes": meta.patch_bytes,
                    "full_bytes": meta.full_bytes,
                }
            )
    return out


def _workers(store: ObjectStore, trainer_rows: list[dict]) -> dict[str, dict]:
    rows = read_rows(store, "worker")
    consumed = trainer_rows[-1].get("per_worker", {}) if trainer_rows else {}
    gate: dict[str, dict] = {}
    for r in trainer_rows:
        accumulate(gate, r.get("gate_by_worker") or {})
    heartbeats = worker_heartbeats(store)
    out = {}
    for name, wrows in rows.items():
        wid = name.removeprefix("worker-")
        busy = sum(r.get("seconds", 0.0) for r in wrows)
        episodes = sum(r.get("episodes", 0) for r in wrows)
        hb = heartbeats.get(wid, {})
        out[wid] = {
            "batches": len(wrows),
            "episodes": episodes,
            "tokens": sum(r.get("tokens", 0) for r in wrows),
            "episodes_per_s": round(episodes / busy, 3) if busy else 0.0,
            "sync_bytes": sum(r.get("sync_bytes", 0) for r in wrows),
            "store_errors": sum(r.get("store_errors", 0) for r in wrows),
            "groups_accepted": consumed.get(wid, {}).get("groups", 0),
            "rejected": {k: n for k, n in consumed.get(wid, {}).items() if k != "groups"},
            "gate_masked_fraction": round(figures(gate[wid])[1], 5) if wid in gate else None,
            "mismatch_kl": round(figures(gate[wid])[0], 6) if wid in gate else None,
            "engine": hb.get("engine"),
            "last_version": hb.get("version"),
        }
    return out


def _trained_batches(store: ObjectStore, rows: list[dict]) -> int:
    """Batches trained on: from the metric rows (retention deletes old
    ledgers); from the ledgers for runs whose rows do not say."""
    if rows and all("batches_trained" in r for r in rows):
        return sum(r["batches_trained"] for r in rows)
    return sum(
        len(json.loads(store.get(k, max_bytes=64 << 20))["keys"])
        for k in store.list("trainer/consumed/")
    )


def _series(rows: list[dict], t0: float) -> dict[str, list]:
    fields = (
        "version",
        "reward_mean",
        "pass_rate",
        "masked_fraction",
        "mismatch_kl",
        "patch_bytes",
        "wait_fraction",
        "loss",
    )
    out = {f: [r.get(f) for r in rows] for f in fields}
    out["wall_s"] = [round(r.get("time", t0) - t0, 2) for r in rows]
    return out


def build_report(store: ObjectStore) -> dict:
    """The report of the run under `store` (see the module docstring for sources)."""
    launch = read_launch(store) or {}
    try:
        spec = RunSpec.from_json(store.get(keys.RUN, max_bytes=MAX_JSON_BYTES))
    except NotFound:
        if not launch:
            raise
        spec = None  # the launcher stopped before the trainer created the run
    rows = read_rows(store, "trainer").get("trainer-main", [])
    versions = _versions(store)
    patches = [v["patch_bytes"] for v in versions if v["version"] > 0]
    tokens = sum(r.get("tokens", 0) for r in rows)
    masked = sum(r.get("masked_fraction", 0.0) * r.get("tokens", 0) for r in rows)
    step_s = sum(r.get("step_seconds", 0.0) for r in rows)
    staleness: Counter = Counter()
    for r in rows:
        staleness.update({int(k): n for k, n in (r.get("staleness") or {}).items()})
    last = rows[-1] if rows else {}
    t0 = launch.get("started") or (rows[0]["time"] - rows[0].get("step_seconds", 0) if rows else 0)
    wall = launch.get("wall_s") or (round(last["time"] - t0, 1) if rows else 0.0)
    consumed, rejected = _trained_batches(store, rows), int(last.get("batches_rejected", 0))
    # Counted by the workers themselves (a row per batch uploaded): the
    # trainer's stale counter misses batches that land after their version
    # left the window, and retention deletes old rollouts.
    workers = _workers(store, rows)
    uploaded = sum(w["batches"] for w in workers.values())
    return {
        "run_id": spec.run_id if spec else None,
        "env": spec.env if spec else launch.get("env"),
        "model": launch.get("model", "unknown"),
        "preset": launch.get("preset"),
        "status": launch.get("status", "unknown"),
        "workers": workers,
        "eval": {w: _json(store, k) for w, k in keys.EVAL.items()},
        "versions_published": versions[-1]["version"] if versions else None,
        "rollouts_consumed": consumed,
        "rollouts_uploaded": uploaded,
        "rollouts_unused": max(0, uploaded - consumed - rejected),
        # Uploaded groups never trained on, over uploaded groups: what the
        # fleet made for nothing (stale, rejected, replayed, surplus).
        "waste_fraction": _waste(workers, rows, spec),
        "episodes_consumed": sum(r.get("episodes", 0) for r in rows),
        "rollouts_dropped_stale": int(last.get("batches_dropped_stale", 0)),
        "rollouts_rejected": rejected,
        "groups_rejected": int(last.get("groups_rejected", 0)),
        "rejected_by_reason": {
            k.removeprefix("rejected_"): int(n)
            for k, n in sorted(last.items())
            if k.startswith("rejected_")
        },
        "signed": spec.signed if spec else None,
        "quarantined": _json(store, keys.QUARANTINE) or {},
        "gate": {
            "masked_fraction": round(masked / tokens, 5) if tokens else 0.0,
            "mismatch_kl_mean": _mean(r.get("mismatch_kl") for r in rows),
        },
        "sync": {
            "full_bytes": next((v["bytes"] for v in versions if v["kind"] == "full"), None),
            "patch_bytes_median": statistics.median(patches) if patches else None,
            "patches": len(patches),
            "anchors": sum(v["kind"] == "full" for v in versions),
        },
        "staleness": {str(k): n for k, n in sorted(staleness.items())},
        "wall_s": wall,
        "trainer_wait_fraction": _share(rows, "wait_seconds", step_s),
        # The share of step time spent waiting for the previous background publication.
        "trainer_publish_blocked_fraction": _share(rows, "publish_blocked_seconds", step_s),
        "publish_seconds_median": _median(r.get("publish_seconds") for r in rows),
        "max_lag": spec.max_lag if spec else None,
        "series": _series(rows, t0),
        "versions": versions,
    }


def _waste(workers: dict, rows: list[dict], spec) -> float | None:
    episodes = sum(w["episodes"] for w in workers.values())
    if spec is None or not episodes:
        return None
    uploaded = episodes / spec.group_size
    trained = sum(r.get("groups", 0) for r in rows)
    return round(max(0.0, 1.0 - trained / uploaded), 4)


def _share(rows: list[dict], key: str, total: float) -> float | None:
    return round(sum(r.get(key, 0.0) for r in rows) / total, 4) if total else None


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 6) if vals else None
