"""`colonnade run`, `colonnade report` and `colonnade config show`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from .envargs import add_env_arg, env_kwargs

# The trainer's settings a run most often changes, as plain flags; every other
# one is --trainer.NAME. Settings the run itself decides are not flags.
TRAINER_SHORTCUTS = ("max_versions", "max_lag", "device")
_SET_BY_RUN = ("store", "endpoint_url", "env", "model", "metrics_port", "metrics_host")
_WORKER_SET_BY_RUN = (*_SET_BY_RUN, "id", "key", "join")


def _run_flags(p: argparse.ArgumentParser) -> None:
    from colonnade.config import RUN_PRESETS, RunConfig, TrainerConfig, WorkerConfig, add_flags

    p.add_argument(
        "--preset",
        metavar="NAME",
        help=f"named settings: {' | '.join(RUN_PRESETS)} (config/presets.py); default: the "
        "one made for --env (smoke, searchqa: demo), custom for any other --env, else demo",
    )
    p.add_argument(
        "--config",
        type=Path,
        help="run.toml: run keys, [trainer], [worker] tables (`colonnade config show` writes one)",
    )
    add_env_arg(p)
    run = p.add_argument_group("run settings", "each is also a top-level key of --config")
    dests = {"run": add_flags(run, RunConfig, skip=("preset",))}
    dests["shortcuts"] = add_flags(run, TrainerConfig, only=TRAINER_SHORTCUTS)
    trainer = p.add_argument_group("trainer settings", "each is also a key of [trainer]")
    dests["trainer"] = add_flags(
        trainer, TrainerConfig, skip=(*TRAINER_SHORTCUTS, *_SET_BY_RUN), prefix="trainer."
    )
    worker = p.add_argument_group("worker settings", "each is also a key of [worker]")
    dests["worker"] = add_flags(worker, WorkerConfig, skip=_WORKER_SET_BY_RUN, prefix="worker.")
    p.set_defaults(setting_dests=dests)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        usage="colonnade run [--preset NAME] [--config FILE] [--env-arg K=V] [--SETTING VALUE ...]",
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
        usage="colonnade config show [--preset NAME] [--config FILE] [--SETTING VALUE ...]",
        help="print the effective run, trainer and worker settings as TOML",
        description="Print every role's settings after preset, --config file and flags, "
        "as a run file that loads back: `colonnade run --config FILE`, and "
        "`colonnade trainer --config FILE` / `colonnade worker --config FILE`, which read "
        "their own table. The paths the run makes under its folder (its store, the keys) "
        "are printed once --out names the folder, else left empty (each role's default). "
        "An unknown environment or model is refused here, in one line.",
    )
    _run_flags(show)
    show.set_defaults(handler=_show)
    doc = csub.add_parser(
        "doc",
        help="print every setting of every role, with its type, default and documentation",
        description="The settings reference (docs/configuration.md) as Markdown, made from "
        "the config fields' own documentation.",
    )
    doc.set_defaults(handler=_doc)


def _resolved(args: argparse.Namespace):
    from colonnade.config import flag_values
    from colonnade.launch import resolve_run_config

    from .main import CliError

    dests = args.setting_dests
    trainer = {
        **flag_values(args, dests["shortcuts"]),
        **flag_values(args, dests["trainer"], prefix="trainer."),
    }
    worker = flag_values(args, dests["worker"], prefix="worker.")
    try:
        return resolve_run_config(
            args.preset,
            args.config,
            trainer=trainer or None,
            worker=worker or None,
            env_kwargs=env_kwargs(args),
            **flag_values(args, dests["run"]),
        )
    except ValueError as e:
        raise CliError(str(e)) from None


def _doc(args: argparse.Namespace) -> int:
    from colonnade.config.reference import reference

    print(reference(), end="")
    return 0


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
