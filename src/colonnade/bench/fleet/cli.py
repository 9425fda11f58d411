"""The command's flags and `run`: the main run, the baseline beside it, the
summary with the joiner's bound, the costs and the verdict, then the text
(and with `--json` the summary as the last line). `colonnade bench fleet`
calls `add_arguments` and `run` (re-exported by the package)."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

from colonnade.config.flags import add_flags, flag_values

from .analysis import joiner_bound, per_version, summarize, verdict
from .costs import SMOLLM2_PATCH_FRACTION, cost_model
from .options import FleetOptions
from .render import render
from .simulation import run_fleet


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_flags(p, FleetOptions)
    p.add_argument(
        "--baseline-workers",
        type=int,
        default=2,
        help="also run this many workers (no churn) for the trainer's wait side by side "
        "(0: skip; default 2)",
    )
    p.add_argument(
        "--out", type=Path, help="keep the runs' stores here (default: a temporary folder)"
    )
    p.add_argument("--json", action="store_true", help="print the summary as one JSON object, last")


def options(args: argparse.Namespace, workers: int | None = None, churn: float | None = None):
    """The options of one run from the flags given (a flag left out keeps its
    default), with `workers` and `churn` overridden for the baseline run."""
    opts = FleetOptions(**flag_values(args, [f.name for f in fields(FleetOptions)]))
    if workers is not None:
        opts.workers = workers
    if churn is not None:
        opts.churn = churn
    opts.check()
    return opts


def log(msg: str) -> None:
    print(f"[bench fleet] {msg}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        main_opts = options(args)
        base = options(args, args.baseline_workers, 0.0) if args.baseline_workers else None
        if args.baseline_workers < 0:
            raise ValueError("out of range: --baseline-workers >= 0")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)  # one line, exit 2, as the CLI's own errors
        return 2
    root = args.out or Path(tempfile.mkdtemp(prefix="colonnade-bench-fleet-"))
    log(f"{main_opts.workers} workers, {main_opts.versions} versions, in {root}")
    res = run_fleet(main_opts, root / f"fleet-{main_opts.workers}")
    table = per_version(res)
    summary = summarize(res)
    if base is not None:
        log(f"baseline: {base.workers} workers")
        b = summarize(run_fleet(base, root / f"fleet-{base.workers}"))
        summary["baseline"] = {k: b[k] for k in (
            "workers", "trainer_wait_fraction", "trainer_wait_fraction_all",
            "requests_per_worker_per_version", "waste_fraction", "seconds")}  # fmt: skip
    summary["joiner_bound"] = joiner_bound(summary, main_opts.anchor_every)
    summary["cost_per_1000_versions"] = cost_model(summary, main_opts)
    summary["cost_per_1000_versions_smollm2_patch"] = cost_model(
        summary, main_opts, patch_fraction=SMOLLM2_PATCH_FRACTION
    )
    summary["targets"] = verdict(summary)
    print(render(table, summary))
    if args.json:
        print(json.dumps(summary))
    return 0
