"""`colonnade status`: a run at a glance from its store (operate/status.py), once or on a loop."""

from __future__ import annotations

import argparse
import json
import sys
import time

WATCH_SECONDS = 5.0  # --watch without a value


def register(sub: argparse._SubParsersAction) -> None:
    from .export import store_flags

    p = sub.add_parser(
        "status",
        help="a run at a glance: version, rate, each worker's state, flags",
        description="Read a run's store (nothing of the trainer's or workers' processes) and "
        "show the newest version, versions per minute, waste, the DPPO gate, and per worker "
        "its engine, version, lag, tokens/s, last heartbeat, accepted and rejected batches "
        "and quarantine, with a state (active, stalled, quarantined, gone). Figures outside "
        'their healthy range (docs/operating.md, "Health") are flagged.',
    )
    p.add_argument(
        "store", metavar="STORE", help="run directory, store directory or s3://bucket/prefix"
    )
    p.add_argument(
        "--json", action="store_true", help="one JSON document (with --watch, one a line)"
    )
    p.add_argument(
        "--watch",
        nargs="?",
        type=float,
        const=WATCH_SECONDS,
        metavar="SECONDS",
        help=f"show it again every SECONDS (default {WATCH_SECONDS:g}) until Ctrl-C",
    )
    store_flags(p)
    p.add_argument(
        "--stalled-after",
        type=float,
        metavar="SECONDS",
        help="silence after which a worker reads as stalled (default: the trainer's default "
        "heartbeat_timeout; give the run's if it set another)",
    )
    p.set_defaults(handler=_status)


def _status(args: argparse.Namespace) -> int:
    from .main import CliError

    for flag, value in (("--watch", args.watch), ("--stalled-after", args.stalled_after)):
        if value is not None and not value > 0:
            raise CliError(f"{flag} {value:g}: seconds > 0")
    store, trusted = _open(args.store, args.endpoint_url, args.profile, args.trust)
    show = _show(_read(store, trusted, args), args.json)
    if args.watch is None:
        return show
    try:
        while True:
            time.sleep(args.watch)
            try:
                status = _read(store, trusted, args)
            except CliError as e:  # the store may come back: keep watching
                print(f"warning: {e}", file=sys.stderr)
                continue
            # A terminal shows the latest only; a pipe or file keeps every one.
            tty = not args.json and sys.stdout.isatty()
            _show(status, args.json, prefix="\x1b[H\x1b[2J" if tty else "\n")
    except KeyboardInterrupt:
        return 0


def _open(url: str, endpoint_url: str | None, profile: str | None, trust: str | None):
    """(the store, the trusted fingerprint or None); CliError for bad input.
    A run directory stands for its store; a local path must exist (opening
    one would create it): `operate.export.store_at`."""
    from colonnade.operate.export import ExportError, store_at

    from .export import trusted
    from .main import CliError

    fingerprint = trusted(trust)
    try:
        return store_at(url, endpoint_url, profile), fingerprint
    except (ExportError, ValueError) as e:
        raise CliError(str(e)) from None


def _read(store, trusted: str | None, args: argparse.Namespace) -> dict:
    from colonnade.operate.status import read_status
    from colonnade.protocol.schemas import SchemaError
    from colonnade.store import NotFound, StoreError

    from .main import CliError

    try:
        return read_status(store, trusted, stalled_after=args.stalled_after)
    except NotFound:
        raise CliError(f"no run.json under {args.store}: not a run") from None
    except SchemaError as e:
        raise CliError(f"{args.store}: run.json does not verify: {e}") from None
    except StoreError as e:
        raise CliError(str(e)) from None


def _show(status: dict, as_json: bool, prefix: str = "") -> int:
    from colonnade.operate.status import render

    print(json.dumps(status) if as_json else prefix + render(status), flush=True)
    return 0
