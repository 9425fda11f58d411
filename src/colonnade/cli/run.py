"""`colonnade run`, `colonnade report` and `colonnade config show`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .envargs import add_env_arg, env_kwargs


def _run_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="smoke (under 3 min) | demo (the default: searchqa)")
    p.add_argument("--config", type=Path, help="run.toml: run keys, [trainer], [worker] tables")
    p.add_argument("--out", help="run directory (default runs/<timestamp>)")
    p.add_argument("--store", help="run prefix (default <out>/store); s3://bucket/prefix too")
    p.add_argument("--endpoint-url", help="S3 endpoint (R2, MinIO, SeaweedFS)")
    p.add_argument("--env", help="environment name or import path")
    add_env_arg(p)
    p.add_argument("--model", help="preset (tiny, smollm2-135m), model directory or hub name")
    p.add_argument("--workers", type=int, help="rollout worker processes (default 2)")
    p.add_argument("--threads", type=int, help="torch threads per process (default 1)")
    p.add_argument(
        "--trainer-ranks",
        type=int,
        help="trainer processes (default 1); from 2 up the trainer runs under torchrun with "
        "FSDP2 (one per GPU on CUDA, gloo on the CPU)",
    )
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "mps", "cpu"],
        help="the trainer's device (default auto); workers take [worker] device",
    )
    p.add_argument("--max-versions", type=int, help="versions the trainer publishes")
    p.add_argument("--max-lag", type=int, help="oldest usable rollout: v - max_lag")
    p.add_argument("--eval-n", type=int, help="held-out tasks evaluated before and after (0: none)")
    p.add_argument(
        "--max-minutes",
        type=float,
        help="wall-clock budget from the start: when spent, the trainer stops after the "
        "version in flight and the final model is still exported, evaluated and reported",
    )
    p.add_argument("--metrics-port", type=int, help="trainer's Prometheus port; worker i: +1+i")
    p.add_argument(
        "--no-warmstart",
        dest="warmstart",
        action="store_false",
        default=None,
        help="train the model as given (no supervised warm start)",
    )
    p.add_argument(
        "--no-sign",
        dest="sign",
        action="store_false",
        default=None,
        help="let workers upload unsigned batches (default: a key pair per worker)",
    )
    p.add_argument(
        "--no-live",
        dest="live",
        action="store_false",
        default=None,
        help="one log line per version instead of the live view",
    )


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="the embedded default: warm start, 1 trainer + N workers, eval, report",
        description="Run end to end on this machine: warm start (cached), held-out eval, "
        "then 1 trainer and N workers as separate processes joined only by the store, "
        "eval of the final version, and report.json / report.html in the run directory. "
        "While training, Ctrl-C stops the trainer after its version and still exports, "
        "evaluates and reports, as --max-minutes does; a second Ctrl-C (or SIGTERM) stops "
        "every process at once and writes the report of what was done.",
    )
    _run_flags(p)
    p.set_defaults(handler=_run)
    r = sub.add_parser(
        "report",
        help="rebuild report.json and report.html of a run from its store",
        description="Rebuild a run's report from the store alone: a run directory, its "
        "store directory, or an s3:// prefix.",
    )
    r.add_argument("run", help="run directory, store directory or s3://bucket/prefix")
    r.add_argument("--endpoint-url", help="S3 endpoint")
    r.add_argument("--out", type=Path, help="where to write (default: the run directory or .)")
    r.set_defaults(handler=_report)
    c = sub.add_parser("config", help="show the effective config of a run")
    csub = c.add_subparsers(dest="config_command", metavar="ACTION", required=True)
    show = csub.add_parser(
        "show",
        help="print the effective run, trainer and worker settings as TOML",
        description="Print every role's settings after preset, --config file and flags.",
    )
    _run_flags(show)
    show.set_defaults(handler=_show)


def _resolved(args: argparse.Namespace):
    from colonnade.launch import resolve_run_config

    from .main import CliError

    trainer = {
        k: v for k in ("max_versions", "max_lag", "device") if (v := getattr(args, k)) is not None
    }
    flags = {
        k: getattr(args, k)
        for k in (
            "out",
            "store",
            "endpoint_url",
            "env",
            "model",
            "workers",
            "threads",
            "trainer_ranks",
            "eval_n",
            "max_minutes",
            "metrics_port",
            "warmstart",
            "live",
            "sign",
        )
    }
    kwargs = env_kwargs(args)
    try:
        return resolve_run_config(
            args.preset, args.config, trainer=trainer or None, env_kwargs=kwargs, **flags
        )
    except ValueError as e:
        raise CliError(str(e)) from None


def _show(args: argparse.Namespace) -> int:
    from colonnade.launch.config import effective_tables, to_toml

    print(to_toml(effective_tables(_resolved(args))), end="")
    return 0


def _run(args: argparse.Namespace) -> int:
    from colonnade.launch.run import launch

    from .main import CliError

    cfg = _resolved(args)
    try:
        report = launch(cfg)
    except (ValueError, FileExistsError) as e:
        raise CliError(str(e)) from None
    from colonnade.rollout.evaluate import figures_line

    ev = report["eval"]
    for which in ("before", "after"):
        if ev.get(which):
            print(f"{which:>6}: {figures_line(ev[which])}")
    status = report["status"]
    if status == "budget":
        status = f"budget (max_minutes {cfg.max_minutes:g} spent)"
    print(f"status: {status}, v{report['versions_published']}, {report['wall_s']} s")
    return 0 if report["status"] in ("finished", "budget") else 1


def _report(args: argparse.Namespace) -> int:
    from colonnade.report import build_report, render_html
    from colonnade.store import NotFound, StoreError, open_store

    from .main import CliError

    url, out = args.run, args.out
    if "://" not in url or url.startswith("file://"):
        local = Path(url.removeprefix("file://"))
        if (local / "store" / "run.json").is_file():  # a run directory
            url, out = str(local / "store"), out or local
        else:
            out = out or local.parent if (local / "run.json").is_file() else out
    out = Path(out or ".")
    try:
        report = build_report(open_store(url, endpoint_url=args.endpoint_url))
    except NotFound:
        raise CliError(f"no run.json under {url}: not a run") from None
    except StoreError as e:
        raise CliError(str(e)) from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.html").write_text(render_html(report))
    print(out / "report.json")
    print(out / "report.html")
    return 0
