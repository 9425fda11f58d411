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
from dataclasses import asdict

from colonnade.protocol import RunSpec, keys, read_meta
from colonnade.protocol.documents import ConsumedLedger, Quarantine, read_signed
from colonnade.protocol.metrics import (
    REJECTED_PREFIX,
    TrainerRow,
    WorkerRow,
    add_gate_stats,
    declared,
    gate_figures,
)
from colonnade.protocol.presence import worker_heartbeats
from colonnade.protocol.reader import RunView, open_run
from colonnade.protocol.schemas import MAX_JSON_BYTES, SchemaError
from colonnade.protocol.signing import Trust
from colonnade.store import NotFound, ObjectStore
from colonnade.telemetry import read_trainer_rows, read_worker_rows

# The trainer's figures per version in report.json's "series" (besides wall_s).
SERIES = declared(
    ("version", "reward_mean", "pass_rate", "masked_fraction", "mismatch_kl", "patch_bytes",
     "wait_fraction", "loss"), (TrainerRow,),
)  # fmt: skip


def _json(store: ObjectStore, key: str):
    try:
        return json.loads(store.get(key, max_bytes=MAX_JSON_BYTES))
    except (NotFound, ValueError):
        return None


def read_launch(store: ObjectStore) -> dict | None:
    return _json(store, keys.LAUNCH)


def _versions(store: ObjectStore, trust: Trust) -> list[dict]:
    """The versions still in the store (retention deletes old ones), as the trainer signed them."""
    found = sorted(v for k in store.list(keys.WEIGHTS) if (v := keys.parse_meta_key(k)) is not None)
    out = []
    for v in found:
        try:
            meta = read_meta(store, v, trust)
        except SchemaError:
            continue
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


def _worker(rows: list[WorkerRow], accepted: dict[str, int], gate: dict | None, hb) -> dict:
    busy = sum(r.seconds for r in rows)
    episodes = sum(r.episodes for r in rows)
    return {
        "batches": len(rows),
        "episodes": episodes,
        "tokens": sum(r.tokens for r in rows),
        "episodes_per_s": round(episodes / busy, 3) if busy else 0.0,
        "sync_bytes": sum(r.sync_bytes for r in rows),
        "store_errors": sum(r.store_errors for r in rows),
        "overflows": sum(r.overflows for r in rows),
        "groups_accepted": accepted.get("groups", 0),
        "rejected": {k: n for k, n in accepted.items() if k != "groups"},
        "gate_masked_fraction": round(gate_figures(gate)[1], 5) if gate else None,
        "mismatch_kl": round(gate_figures(gate)[0], 6) if gate else None,
        "engine": hb.engine if hb else None,
        # A worker gone long enough has no heartbeat left (retention): its rows say.
        "last_version": hb.version if hb else max((r.version for r in rows), default=None),
    }


def _workers(inbox: ObjectStore, trainer_rows: list[TrainerRow]) -> dict[str, dict]:
    consumed = trainer_rows[-1].per_worker if trainer_rows else {}
    gate: dict[str, dict] = {}
    for r in trainer_rows:
        add_gate_stats(gate, r.gate_by_worker)
    heartbeats = worker_heartbeats(inbox)
    return {
        wid: _worker(rows, consumed.get(wid, {}), gate.get(wid), heartbeats.get(wid))
        for wid, rows in read_worker_rows(inbox).items()
    }


def _trained_batches(store: ObjectStore, trust: Trust, rows: list[TrainerRow]) -> int:
    """Batches trained on: from the metric rows (retention deletes old
    ledgers); from the ledgers when there are no rows."""
    if rows:
        return sum(r.batches_trained for r in rows)
    total = 0
    for k in store.list(keys.CONSUMED):
        if keys.parse_consumed_key(k) is not None:
            try:
                ledger = read_signed(store, k, ConsumedLedger, trust)
            except SchemaError:
                continue
            total += len(ledger.keys) if ledger is not None else 0
    return total


def _quarantined(store: ObjectStore, trust: Trust) -> dict[str, dict]:
    try:
        found = read_signed(store, keys.QUARANTINE, Quarantine, trust)
    except SchemaError:
        return {}
    return {w: asdict(d) for w, d in found.decisions.items()} if found is not None else {}


def _series(rows: list[TrainerRow], t0: float) -> dict:
    out: dict = {f: [getattr(r, f) for r in rows] for f in SERIES}
    out["wall_s"] = [round(r.time - t0, 2) for r in rows]
    # The environment's declared metrics, by name: a value per row (None where absent).
    names = dict.fromkeys(n for r in rows for n in r.env_metrics)
    out["env_metrics"] = {n: [r.env_metrics.get(n) for r in rows] for n in names}
    return out


def build_report(store: ObjectStore, trusted: str | None = None) -> dict:
    """The report of the run under `store` (see the module docstring for
    sources); the trainer's documents checked against the key that signed
    run.json, which must be `trusted` (a fingerprint) when given."""
    launch = read_launch(store) or {}
    view: RunView | None
    try:
        view = open_run(store, trusted)
    except NotFound:
        if not launch:
            raise
        view = None  # the launcher stopped before the trainer created the run
    if view is None:
        return _report(store, launch, None, [], [], {}, 0)
    rows = read_trainer_rows(store, view.trust)
    versions = _versions(store, view.trust)
    # Counted by the workers themselves (a row per batch uploaded): the
    # trainer's stale counter misses batches that land after their version
    # left the window, and retention deletes old rollouts.
    workers = _workers(view.inbox, rows)
    consumed = _trained_batches(store, view.trust, rows)
    report = _report(store, launch, view.spec, rows, versions, workers, consumed)
    report["quarantined"] = _quarantined(store, view.trust)
    report["trainer_key"] = view.trust.fingerprint
    return report


def _report(store, launch, spec: RunSpec | None, rows, versions, workers, consumed) -> dict:
    patches = [v["patch_bytes"] for v in versions if v["version"] > 0]
    tokens = sum(r.tokens for r in rows)
    masked = sum(r.masked_fraction * r.tokens for r in rows)
    step_s = sum(r.step_seconds for r in rows)
    staleness: Counter = Counter()
    for r in rows:
        staleness.update({int(k): n for k, n in r.staleness.items() if k.isdigit()})
    counts = rows[-1].counts if rows else {}  # cumulative: the last row's
    t0 = launch.get("started") or (rows[0].time - rows[0].step_seconds if rows else 0)
    wall = launch.get("wall_s") or (round(rows[-1].time - t0, 1) if rows else 0.0)
    rejected = counts.get("batches_rejected", 0)
    uploaded = sum(w["batches"] for w in workers.values())
    return {
        "run_id": spec.run_id if spec else None,
        "env": spec.env if spec else launch.get("env"),
        "model": launch.get("model", "unknown"),
        "preset": launch.get("preset"),
        "status": launch.get("status", "unknown"),
        "workers": workers,
        "eval": {
            **{w: _json(store, k) for w, k in keys.EVAL.items()},
            "during": _evals_during(store),
        },
        "versions_published": versions[-1]["version"] if versions else None,
        "rollouts_consumed": consumed,
        "rollouts_uploaded": uploaded,
        "rollouts_unused": max(0, uploaded - consumed - rejected),
        # Uploaded groups never trained on, over uploaded groups: what the
        # fleet made for nothing (stale, rejected, replayed, surplus).
        "waste_fraction": _waste(workers, rows, spec),
        "episodes_consumed": sum(r.episodes for r in rows),
        "rollouts_dropped_stale": counts.get("batches_dropped_stale", 0),
        "rollouts_rejected": rejected,
        "groups_rejected": counts.get("groups_rejected", 0),
        # Episodes trained on that a tool reply past the token budget ended.
        "episodes_overflow": counts.get("episodes_overflow", 0),
        "rewards": _rewards(counts),
        "rejected_by_reason": {
            k.removeprefix(REJECTED_PREFIX): n
            for k, n in sorted(counts.items())
            if k.startswith(REJECTED_PREFIX)
        },
        "signed": spec.signed if spec else None,
        "quarantined": {},
        "trainer_key": None,
        "gate": {
            "masked_fraction": round(masked / tokens, 5) if tokens else 0.0,
            "mismatch_kl_mean": _mean(r.mismatch_kl for r in rows),
        },
        "sync": {
            "full_bytes": next((v["bytes"] for v in versions if v["kind"] == "full"), None),
            "patch_bytes_median": statistics.median(patches) if patches else None,
            "patches": len(patches),
            "anchors": sum(v["kind"] == "full" for v in versions),
            "worker_bytes_total": sum(w["sync_bytes"] for w in workers.values()),
        },
        "config": launch.get("config") or _spec_settings(spec),
        "staleness": {str(k): n for k, n in sorted(staleness.items())},
        "wall_s": wall,
        "trainer_wait_fraction": _share([r.wait_seconds for r in rows], step_s),
        # The share of step time spent waiting for the previous background publication.
        "trainer_publish_blocked_fraction": _share(
            [r.publish_blocked_seconds for r in rows], step_s
        ),
        # The share of step time the spot checks took (the rows they recomputed).
        "trainer_spot_fraction": _share([r.spot_seconds for r in rows], step_s),
        "spot_rows": sum(r.spot_rows for r in rows),
        "publish_seconds_median": _median(r.publish_seconds for r in rows),
        "max_lag": spec.max_lag if spec else None,
        "series": _series(rows, t0),
        "versions": versions,
    }


def _evals_during(store: ObjectStore) -> list[dict]:
    """The run's held-out evals while training (the launcher's), by version."""
    out = []
    for key in sorted(store.list(keys.EVAL_DURING)):
        figures = _json(store, key)
        if isinstance(figures, dict) and isinstance(figures.get("version"), int):
            out.append(figures)
    return out


def _spec_settings(spec: RunSpec | None) -> dict:
    """What run.json says of the settings, for a run no launcher started
    (the launcher records every role's settings in full)."""
    if spec is None:
        return {}
    keep = ("env", "env_kwargs", "precision", "group_size", "groups_per_batch", "max_lag")
    return {"run.json": {k: getattr(spec, k) for k in keep} | {"sampling": spec.sampling}}


def _waste(workers: dict, rows: list[TrainerRow], spec) -> float | None:
    episodes = sum(w["episodes"] for w in workers.values())
    if spec is None or not episodes:
        return None
    uploaded = episodes / spec.group_size
    trained = sum(r.groups for r in rows)
    return round(max(0.0, 1.0 - trained / uploaded), 4)


def _rewards(counts: dict) -> dict:
    """Episodes trained on whose reward the trainer recomputed, or took from a
    trusted worker where it could not (train/trust.py), and their shares."""
    got = {k: counts.get(f"rewards_{k}", 0) for k in ("recomputed", "trusted")}
    total = sum(got.values())
    return {**got, **{f"{k}_share": round(n / total, 4) if total else None
                      for k, n in got.items()}}  # fmt: skip


def _share(seconds: list[float], total: float) -> float | None:
    return round(sum(seconds) / total, 4) if total else None


def _median(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(statistics.median(vals), 4) if vals else None


def _mean(values) -> float | None:
    vals = [v for v in values if v is not None]
    return round(sum(vals) / len(vals), 6) if vals else None
