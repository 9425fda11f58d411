"""End-to-end: asynchronous against synchronous training, and 1 against 2 workers.

Side by side in one run, each case a full `colonnade run --preset smoke`
(held-out eval off; the warm start is cached and shared):

- async, 2 workers: max_lag 2 (the default);
- sync, 2 workers: max_lag 0, every step waits for rollouts of its version;
- async and sync with 1 worker: on a 2-core box, trainer + 1 worker is the
  case where the processes do not share cores, so overlap can pay.

Per case: wall time from the trainer's start until the training pass rate
(mean of 3 consecutive versions) first reaches `--target`, the trainer's
wait fraction, and episodes/s generated and consumed. The ratio of sync to
async time-to-target is the speed-up asynchrony buys.

Both time and waiting are also given from the end of the first version on
("steady"): the first version waits for the fleet to start (processes,
imports, the first sync), which is the same for both modes and a large
share of a smoke run; a run of hours pays it once.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from colonnade.protocol.metrics import TrainerRow, WorkerRow

CASES = (
    ("async, 2 workers", 2, 2),
    ("sync, 2 workers", 0, 2),
    ("async, 1 worker", 2, 1),
    ("sync, 1 worker", 0, 1),
)
TARGETS = {"speedup": 1.5, "wait_fraction": 0.20}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", type=float, default=0.8, help="training pass rate to reach")
    p.add_argument("--max-versions", type=int, default=40, help="versions per case")
    p.add_argument("--out", type=Path, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--quick", action="store_true", help="4 versions per case (a smoke test)")
    p.add_argument("--json", action="store_true", help="print result rows as JSON on stdout")


def log(msg: str) -> None:
    print(f"[bench e2e] {msg}", file=sys.stderr, flush=True)


def time_to_target(
    rows: list[TrainerRow], target: float, window: int = 3, steady: bool = False
) -> float | None:
    """Seconds from the trainer's start (`steady`: from the end of its first
    version) until `window` versions average `target` pass rate."""
    if not rows:
        return None
    t0 = rows[0].time - (0.0 if steady else rows[0].step_seconds)
    for i in range(window - 1, len(rows)):
        recent = [r.pass_rate for r in rows[i - window + 1 : i + 1]]
        if sum(recent) / window >= target:
            return rows[i].time - t0
    return None


def summarize(
    trainer: list[TrainerRow], workers: dict[str, list[WorkerRow]], target: float
) -> dict:
    """The figures of one case from its metric rows."""
    t0 = trainer[0].time - trainer[0].step_seconds
    span = max(1e-9, trainer[-1].time - t0)
    generated = sum(r.episodes for rows in workers.values() for r in rows)
    return {
        "time_to_target_s": time_to_target(trainer, target),
        "steady_to_target_s": time_to_target(trainer, target, steady=True),
        "train_seconds": round(span, 2),
        "versions": len(trainer),
        "wait_fraction": _wait(trainer),
        "steady_wait_fraction": _wait(trainer[1:]),
        "episodes_generated_per_s": round(generated / span, 2),
        "episodes_trained_per_s": round(sum(r.episodes for r in trainer) / span, 2),
        "final_pass_rate": round(sum(r.pass_rate for r in trainer[-3:]) / 3, 3),
    }


def _wait(rows: list[TrainerRow]) -> float:
    step = sum(r.step_seconds for r in rows)
    return round(sum(r.wait_seconds for r in rows) / step, 4) if step else 0.0


def run_case(out: Path, lag: int, workers: int, versions: int, target: float) -> dict:
    from colonnade.launch import resolve_run_config
    from colonnade.launch.run import launch
    from colonnade.protocol.reader import open_run
    from colonnade.store import LocalStore
    from colonnade.telemetry import read_trainer_rows, read_worker_rows

    cfg = resolve_run_config(
        "smoke", out=str(out), workers=workers, eval_n=0, live=False,
        trainer={"max_lag": lag, "max_versions": versions},
    )  # fmt: skip
    report = launch(cfg)
    if report["status"] != "finished":
        raise SystemExit(f"error: the run in {out} ended {report['status']}")
    store = LocalStore(out / "store")
    view = open_run(store)
    return summarize(read_trainer_rows(store, view.trust), read_worker_rows(view.inbox), target)


def _speedup(rows: list[dict], workers: int, field: str = "time_to_target_s") -> float | None:
    """Sync time-to-target over async, at this worker count."""
    t = {r["max_lag"] == 0: r[field] for r in rows if r["workers"] == workers}
    return t[True] / t[False] if t.get(True) and t.get(False) else None


def _cell(t: float | None, s: float | None) -> str:
    """Seconds and the sync/this ratio, e.g. '12.4 (1.21x)'."""
    if not t:
        return "not hit"
    return f"{t:.1f} ({s / t:.2f}x)" if s else f"{t:.1f}"


def _table(rows: list[dict], target: float) -> str:
    lines = [
        f"time to training pass rate {target} (mean of 3 versions), smoke preset, "
        "1 thread per process; steady: from the end of the first version",
        f"{'case':18}{'to target s':>15}{'steady s':>15}{'wait':>7}{'steady':>7}"
        f"{'gen ep/s':>10}{'train ep/s':>11}{'final pass':>11}",
    ]
    for r in rows:
        sync = next(x for x in rows if x["max_lag"] == 0 and x["workers"] == r["workers"])
        lines.append(
            f"{r['case']:18}{_cell(r['time_to_target_s'], sync['time_to_target_s']):>15}"
            f"{_cell(r['steady_to_target_s'], sync['steady_to_target_s']):>15}"
            f"{100 * r['wait_fraction']:>6.0f}%{100 * r['steady_wait_fraction']:>6.0f}%"
            f"{r['episodes_generated_per_s']:>10.1f}"
            f"{r['episodes_trained_per_s']:>11.1f}{r['final_pass_rate']:>11.3f}"
        )
    return "\n".join(lines)


def _verdict(rows: list[dict]) -> str:
    parts = []
    for label, field in (("from start", "time_to_target_s"), ("steady", "steady_to_target_s")):
        speeds = {w: _speedup(rows, w, field) for w in (2, 1)}
        parts.append(
            f"{label}: "
            + ", ".join(
                f"{w} worker(s) {x:.2f}x" if x else f"{w} worker(s) n/a" for w, x in speeds.items()
            )
        )
    return (
        f"async speed-up over sync ({'; '.join(parts)}; target >= {TARGETS['speedup']}x); "
        f"trainer waiting with 2 workers: {100 * rows[0]['wait_fraction']:.0f}% "
        f"(steady {100 * rows[0]['steady_wait_fraction']:.0f}%; "
        f"target <= {100 * TARGETS['wait_fraction']:.0f}%)"
    )


def run(args: argparse.Namespace) -> int:
    versions = 4 if args.quick else args.max_versions
    if versions < 3 or not 0 < args.target <= 1:
        raise SystemExit("error: --max-versions must be >= 3 and --target within (0, 1]")
    root = args.out or Path(tempfile.mkdtemp(prefix="colonnade-bench-e2e-"))
    rows = []
    for name, lag, workers in CASES:
        log(f"{name}: max_lag {lag}, {versions} versions")
        out = root / name.replace(", ", "-").replace(" ", "")
        rows.append({"case": name, "max_lag": lag, "workers": workers,
                     **run_case(out, lag, workers, versions, args.target)})  # fmt: skip
    if args.json:
        print(json.dumps(rows))
    else:
        print(_table(rows, args.target))
        print(_verdict(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/e2e.py", description=__doc__.split("\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))
