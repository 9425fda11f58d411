"""`--env-arg KEY=VALUE`, the same on every command that takes `--env`."""

from __future__ import annotations

import argparse

HELP = (
    "an argument of the environment's load_environment, repeatable: VALUE is read as JSON "
    'when it parses (3, 0.5, true, [1, 2], {"a": 1}), else as a string; e.g. '
    "--env-arg size=200 for rg:<dataset> (see docs/environments.md)"
)


def add_env_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--env-arg", action="append", dest="env_args", metavar="KEY=VALUE", help=HELP)


def env_kwargs(args: argparse.Namespace) -> dict | None:
    """The parsed and checked --env-arg values; None when none was given."""
    from colonnade.envs.args import parse_env_args

    from .main import CliError

    if not args.env_args:
        return None
    try:
        return parse_env_args(args.env_args)
    except ValueError as e:
        raise CliError(str(e)) from None
