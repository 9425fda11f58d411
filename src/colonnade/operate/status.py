"""`colonnade status`: a run at a glance, from its store alone.

The run's figures are the report's (`report.build_report`: the newest
version, waste, the DPPO gate over the run and per worker, each worker's
accepted groups and rejected batches, the quarantine). A glance adds what a
report does not keep: how long ago each worker was heard from (its
heartbeat's store time, as the trainer judges it), the version it last
reported, its recent tokens/s, the trainer's recent versions per minute, and
a state per worker. A figure with a healthy range (`HEALTH`, the one table
of them; docs/operating.md says what each means and what to do) is flagged
when it falls outside it.

`read_status` reads the store (`gather`) and hands the facts to
`status_of`; that and `worker_state`, `flags_of` and `render` are pure.
cli/status.py prints them, once or on a loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from colonnade.config import TrainerConfig
from colonnade.protocol import RunSpec, read_latest
from colonnade.protocol.documents import WorkerHeartbeat
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.metrics import REJECTED_PREFIX, TrainerRow, WorkerRow
from colonnade.protocol.presence import worker_heartbeats
from colonnade.protocol.reader import open_run
from colonnade.protocol.schemas import SchemaError
from colonnade.protocol.signing import Trust
from colonnade.report import build_report
from colonnade.store import ObjectStore
from colonnade.telemetry import read_trainer_rows, read_worker_rows

# Rows a "recent" figure spans: enough to smooth one slow step or batch, few
# enough that a change shows within a few versions.
RECENT_ROWS = 10
# Workers' and the trainer's clocks are assumed within a few seconds of each
# other (as `protocol.presence` does); a report is matched to the versions
# published this much before it, so that skew never reads as lag.
CLOCK_SLACK_S = 5.0
# Past this silence a worker is gone, not stalled: retention deletes its
# heartbeat then, and it would rejoin as a newcomer.
GONE_AFTER_S = TrainerConfig.forget_workers_seconds
STATES = ("active", "stalled", "quarantined", "gone")


@dataclass(frozen=True)
class Healthy:
    """A figure's healthy range, bounds included (None: unbounded); a str
    `high` names the RunSpec field that bounds it in this run."""

    low: float | None
    high: float | str | None
    why: str  # what a figure outside the range means


HEALTH: dict[str, Healthy] = {
    # The run (the report's figures, over the whole run)
    "waste_fraction": Healthy(None, 0.20, "uploaded groups never trained on: the fleet makes "
                              "more than the trainer takes, or its batches arrive stale"),
    "masked_fraction": Healthy(None, 0.025, "tokens the DPPO gate masked: the workers' "
                               "log-probs have drifted from the trainer's"),
    "mismatch_kl": Healthy(-0.04, 0.04, "KL per token between the workers' log-probs and the "
                           "trainer's: the policy the batches came from is not the one trained"),
    "workers_active": Healthy(1, None, "no worker heard from lately: nothing generates"),
    # Each worker (masked_fraction and mismatch_kl too, over its own tokens)
    "lag": Healthy(0, "max_lag", "versions behind the newest (counted from its last report): "
                   "the trainer drops its batches as stale"),
    "last_seen_s": Healthy(0, TrainerConfig.heartbeat_timeout, "seconds since its heartbeat: "
                           "the trainer no longer counts it alive"),
    "rejected_batches": Healthy(0, 0, "batches the trainer refused: see the reasons"),
    "quarantined": Healthy(0, 0, "the trainer refuses every batch of it: see the decision"),
}  # fmt: skip

Bounds = dict[str, tuple[float | None, float | None]]


def bounds(spec: RunSpec, stalled_after: float | None = None) -> Bounds:
    """HEALTH's ranges for this run: RunSpec fields resolved, and the
    heartbeat's bound replaced by `stalled_after` when given."""
    out = {
        name: (h.low, getattr(spec, h.high) if isinstance(h.high, str) else h.high)
        for name, h in HEALTH.items()
    }
    if stalled_after is not None:
        out["last_seen_s"] = (out["last_seen_s"][0], stalled_after)
    return out


def check(figure: str, value, low, high) -> dict | None:
    """A flag for `value` outside [low, high], else None (and for no value)."""
    if value is None or ((low is None or value >= low) and (high is None or value <= high)):
        return None
    return {"figure": figure, "value": value, "low": low, "high": high}


def flags_of(figures: dict, limits: Bounds) -> list[dict]:
    """The flags of those `figures` that have a range in `limits`."""
    return [f for name, value in figures.items()
            if name in limits and (f := check(name, value, *limits[name]))]  # fmt: skip


def worker_state(
    age: float | None, quarantined: bool, done: bool, stalled_after: float,
    gone_after: float = GONE_AFTER_S,
) -> str:  # fmt: skip
    """One of STATES, from the heartbeat's age (None: it has none)."""
    if quarantined:
        return "quarantined"
    if age is None or age > gone_after or (done and age > stalled_after):
        return "gone"  # left, or exited as the run ended
    return "stalled" if age > stalled_after else "active"


def rate(trainer: list[TrainerRow]) -> float | None:
    """Versions per minute over the trainer's recent rows."""
    recent = trainer[-RECENT_ROWS - 1 :]
    if len(recent) < 2 or recent[-1].time <= recent[0].time:
        return None
    versions = recent[-1].version - recent[0].version
    return round(60 * versions / (recent[-1].time - recent[0].time), 3)


def tokens_per_s(rows: list[WorkerRow]) -> float | None:
    """Tokens a second of a worker's recent batches (generation and upload)."""
    recent = rows[-RECENT_ROWS:]
    busy = sum(r.seconds for r in recent)
    return round(sum(r.tokens for r in recent) / busy, 1) if busy else None


def last_report(hb: WorkerHeartbeat | None, rows: list[WorkerRow]) -> tuple[float, int] | None:
    """(when, version) of a worker's newest word: its heartbeat or its last
    batch's row, whichever is newer (a heartbeat is rewritten less often)."""
    said = [(r.time, r.version) for r in rows[-1:]]
    if hb is not None and hb.version is not None:
        said.append((hb.time, hb.version))
    return max(said, default=None)


def published_at(trainer: list[TrainerRow], when: float) -> int:
    """The newest version the trainer had made by `when` (v0 before any row)."""
    return max((r.version for r in trainer if r.time <= when), default=0)


@dataclass(frozen=True)
class Facts:
    """What `gather` read from the store."""

    spec: RunSpec
    report: dict  # build_report's
    trainer: list[TrainerRow]
    workers: dict[str, list[WorkerRow]]
    heartbeats: dict[str, WorkerHeartbeat]
    heard: dict[str, float]  # worker -> its heartbeat's store time
    done: bool  # latest.json says the run is over


def gather(store: ObjectStore, trusted: str | None = None) -> Facts:
    """Everything `status_of` needs; NotFound without run.json, SchemaError
    for a run.json that does not verify (against `trusted`, a fingerprint)."""
    view = open_run(store, trusted)
    report = build_report(store, view.trust.fingerprint)
    listing = list_inbox(view.inbox)
    return Facts(
        spec=view.spec,
        report=report,
        trainer=read_trainer_rows(store, view.trust),
        workers=read_worker_rows(view.inbox),
        heartbeats=worker_heartbeats(view.inbox, listing),
        heard=listing.heartbeats,
        done=_done(store, view.trust),
    )


def _done(store: ObjectStore, trust: Trust) -> bool:
    try:
        latest = read_latest(store, trust)
    except SchemaError:
        return False
    return latest is not None and latest.done


def read_status(
    store: ObjectStore, trusted: str | None = None, *, now: float | None = None,
    stalled_after: float | None = None,
) -> dict:  # fmt: skip
    """The run under `store` at a glance (`status_of`); errors as `gather`'s."""
    return status_of(gather(store, trusted), time.time() if now is None else now, stalled_after)


def status_of(facts: Facts, now: float, stalled_after: float | None = None) -> dict:
    """The status document (docs/operating.md): the run's figures, each
    worker's, and the flags of those outside their healthy range."""
    limits = bounds(facts.spec, stalled_after)
    report = facts.report
    ids = set(report["workers"]) | set(facts.heartbeats) | set(report["quarantined"])
    workers = [_worker(w, facts, now, limits) for w in sorted(ids)]
    figures = {
        "waste_fraction": report["waste_fraction"],
        "masked_fraction": report["gate"]["masked_fraction"],
        "mismatch_kl": report["gate"]["mismatch_kl_mean"],
        "workers_active": sum(w["state"] == "active" for w in workers),
    }
    run_flags = flags_of(
        {k: v for k, v in figures.items() if not (facts.done and k == "workers_active")}, limits
    )
    last = facts.trainer[-1].time if facts.trainer else None
    return {
        "run_id": facts.spec.run_id,
        "env": facts.spec.env,
        "version": report["versions_published"],
        "done": facts.done,
        "versions_per_minute": rate(facts.trainer),
        "since_version_s": None if last is None else round(max(0.0, now - last), 1),
        **figures,
        "max_lag": facts.spec.max_lag,
        "workers": workers,
        "flags": run_flags,
        "healthy": {
            k: {"low": lo, "high": hi, "why": HEALTH[k].why} for k, (lo, hi) in limits.items()
        },
    }


def _worker(wid: str, facts: Facts, now: float, limits: Bounds) -> dict:
    """One worker's entry of the status document."""
    got = facts.report["workers"].get(wid, {})
    rows, hb = facts.workers.get(wid, []), facts.heartbeats.get(wid)
    decision = facts.report["quarantined"].get(wid)
    # A store's clock a little ahead of ours is not a heartbeat from the future.
    age = round(max(0.0, now - facts.heard[wid]), 1) if wid in facts.heard else None
    state = worker_state(age, decision is not None, facts.done, limits["last_seen_s"][1])
    counters = sorted(got.get("rejected", {}).items())
    rejected = {
        k.removeprefix(REJECTED_PREFIX): n for k, n in counters if k.startswith(REJECTED_PREFIX)
    }
    said = last_report(hb, rows)
    newest = facts.report["versions_published"]
    figures = {
        "lag": None if said is None or newest is None else newest - said[1],
        "last_seen_s": age,
        "rejected_batches": sum(rejected.values()),
        "quarantined": int(decision is not None),
        "masked_fraction": got.get("gate_masked_fraction"),
        "mismatch_kl": got.get("mismatch_kl"),
    }
    return {
        "id": wid,
        "engine": hb.engine if hb is not None else None,
        "version": None if said is None else said[1],
        **figures,
        "state": state,
        # A worker that left is no longer part of the run's health.
        "flags": [] if state == "gone" else flags_of(figures, _lag_allowed(limits, facts, said)),
        "tokens_per_s": tokens_per_s(rows),
        "batches": got.get("batches", len(rows)),
        "accepted_groups": got.get("groups_accepted", 0),
        "rejected": rejected,
        "quarantine": decision,
    }


def _lag_allowed(limits: Bounds, facts: Facts, said: tuple[float, int] | None) -> Bounds:
    """`limits` with the lag's bound raised by the versions published since
    the worker last reported: a report some seconds old is not lag."""
    newest = facts.report["versions_published"]
    if said is None or newest is None:
        return limits
    since = max(0, newest - published_at(facts.trainer, said[0] - CLOCK_SLACK_S))
    low, high = limits["lag"]
    return {**limits, "lag": (low, None if high is None else high + since)}


# -- text ----------------------------------------------------------------------------------

COLUMNS = (("id", "id"), ("engine", "engine"), ("version", "version"), ("lag", "lag"),
           ("tokens_per_s", "tok/s"), ("last_seen_s", "seen s"), ("accepted_groups", "groups"),
           ("rejected", "rejected"), ("mismatch_kl", "KL"), ("masked_fraction", "masked"),
           ("state", "state"))  # fmt: skip
# A column whose flag goes by another name than the column's.
FLAGGED_AS = {"rejected": "rejected_batches", "state": "quarantined"}


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ",".join(f"{k}:{n}" for k, n in value.items()) or "-"
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render(status: dict) -> str:
    """The status as a compact text table; a flagged figure is marked `!`."""
    version = "-" if status["version"] is None else f"v{status['version']}"
    head = (f"run {status['run_id']} ({status['env']}): {version}"
            f"{', done' if status['done'] else ''}, {_cell(status['versions_per_minute'])} "
            f"versions/min, last {_cell(status['since_version_s'])} s ago")  # fmt: skip
    flagged = {f["figure"] for f in status["flags"]}
    figures = (("waste_fraction", "waste"), ("masked_fraction", "gate masked"),
               ("mismatch_kl", "mismatch KL"), ("workers_active", "workers active"))  # fmt: skip
    run = "  ".join(f"{label} {_cell(status[k])}{'!' * (k in flagged)}" for k, label in figures)
    rows = [[label for _, label in COLUMNS] + ["flags"]]
    for w in status["workers"]:
        marked = {f["figure"] for f in w["flags"]}
        cells = [_cell(w[k]) + "!" * (FLAGGED_AS.get(k, k) in marked) for k, _ in COLUMNS]
        rows.append([*cells, ",".join(f["figure"] for f in w["flags"]) or "-"])
    lines = [head, run, *(_table(rows) if status["workers"] else ["no workers"])]
    lines += [f"{w['id']} quarantined at v{q['version']}: {q['reason']}"
              for w in status["workers"] if (q := w["quarantine"]) is not None]  # fmt: skip
    lines += [_flag_line(f) for f in status["flags"]]
    return "\n".join(lines)


def _flag_line(flag: dict) -> str:
    low, high = _cell(flag["low"]), _cell(flag["high"])
    return f"flag: {flag['figure']} {_cell(flag['value'])} outside [{low}, {high}]: " + (
        HEALTH[flag["figure"]].why
    )
