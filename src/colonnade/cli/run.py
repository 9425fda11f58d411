"""`colonnade run`: the embedded default (trainer + workers on one machine)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="run the embedded default: warm start, 1 trainer and N workers over a local store",
        description="Run the embedded default end to end on this machine. Not built yet: "
        "this release ships the object store and the PULSE weight-patch codec.",
    )
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from .main import CliError

    raise CliError(
        "`colonnade run` is not built yet: this release has the object store and PULSE "
        "patches (try `colonnade pulse --help` and `colonnade bench pulse`)"
    )
