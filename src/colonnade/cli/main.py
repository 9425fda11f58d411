"""The `colonnade` command line: one subcommand per role or tool.

Each subcommand lives in its own module and registers itself here; heavy
imports (torch, transformers) happen inside the handlers so `--help` is fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from colonnade import __version__

from . import (
    bench,
    evaluate,
    export,
    exporter,
    invite,
    plan,
    pulse,
    roles,
    run,
    serve,
    status,
    tools,
)


class CliError(Exception):
    """A user-facing failure: printed as one `error: …` line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colonnade",
        description="Decentralized RL post-training: many rollout workers, one trainer, "
        "joined only by an object store (S3, R2, MinIO or a local directory).",
    )
    parser.add_argument("--version", action="version", version=f"colonnade {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    run.register(sub)
    roles.register(sub)
    roles.register_keys(sub)
    evaluate.register(sub)
    export.register(sub)
    exporter.register(sub)
    invite.register(sub)
    pulse.register(sub)
    serve.register(sub)
    bench.register(sub)
    status.register(sub)
    plan.register(sub)
    tools.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except CliError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
