"""`colonnade exporter`: a run's Prometheus endpoint fed from its store alone
(telemetry/fleet.py), for a machine that reaches no trainer or worker."""

from __future__ import annotations

import argparse
import sys
import time

PORT = 9400  # deploy/prometheus.yml's first target
INTERVAL_SECONDS = 15.0


def register(sub: argparse._SubParsersAction) -> None:
    from .export import store_flags

    p = sub.add_parser(
        "exporter",
        help="serve a run's trainer and worker figures to Prometheus, read from its store",
        description="Read the trainer's signed metric rows and every worker's (registered "
        "ones, in a signed run) from a run's store and serve them on a Prometheus endpoint, "
        "under the names and labels the processes' own endpoints use (role, id): the "
        "dashboard works unchanged. Nothing but the store is reached. Each poll reads only "
        "what changed. Runs until Ctrl-C.",
    )
    p.add_argument(
        "store", metavar="STORE", help="run directory, store directory or s3://bucket/prefix"
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        metavar="HOST",
        help="the address to bind (default 127.0.0.1; 0.0.0.0: every interface, with no "
        "authentication)",
    )
    p.add_argument("--metrics-port", type=int, default=PORT, metavar="N", help=f"default {PORT}")
    p.add_argument(
        "--interval",
        type=float,
        default=INTERVAL_SECONDS,
        metavar="S",
        help=f"seconds between reads of the store (default {INTERVAL_SECONDS:g})",
    )
    store_flags(p)
    p.set_defaults(handler=_exporter)


def _exporter(args: argparse.Namespace) -> int:
    from .main import CliError

    if not args.interval > 0:
        raise CliError(f"--interval {args.interval:g}: seconds > 0")
    if not 0 <= args.metrics_port <= 65535:
        raise CliError(f"--metrics-port {args.metrics_port}: 0 to 65535")
    store, view = _open(args)
    from colonnade.telemetry import follow_run

    exporter = _serve(args)
    reader = follow_run(store, view, exporter)
    print(
        f"serving run {view.spec.run_id} on http://{args.metrics_host}:{exporter.port}/metrics, "
        f"reading {store.url} every {args.interval:g} s (Ctrl-C stops)",
        file=sys.stderr,
        flush=True,
    )
    followed = None
    try:
        while True:
            if not reader.poll_safely():
                print("warning: the store did not answer; trying again", file=sys.stderr)
            if len(reader.workers) != followed:
                followed = len(reader.workers)
                print(f"workers followed: {followed}", file=sys.stderr, flush=True)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    finally:
        exporter.close()


def _open(args: argparse.Namespace):
    """(the store, the run as read from it); CliError for bad input. A run
    directory stands for its store; a local path must exist (opening one
    would create it)."""
    from colonnade.operate.export import ExportError, store_at
    from colonnade.protocol.reader import open_run
    from colonnade.protocol.schemas import SchemaError
    from colonnade.store import NotFound, StoreError

    from .export import trusted
    from .main import CliError

    fingerprint = trusted(args.trust)
    try:
        store = store_at(args.store, args.endpoint_url, args.profile)
        view = open_run(store, fingerprint, endpoint_url=args.endpoint_url, profile=args.profile)
    except NotFound:
        raise CliError(f"no run.json under {args.store}: not a run") from None
    except SchemaError as e:
        raise CliError(f"{args.store}: run.json does not verify: {e}") from None
    except (ExportError, StoreError, ValueError) as e:
        raise CliError(str(e)) from None
    return store, view


def _serve(args: argparse.Namespace):
    from colonnade.telemetry import Exporter

    from .main import CliError

    try:
        return Exporter(args.metrics_port, "main", addr=args.metrics_host, env_metrics=None)
    except OSError as e:  # in use, or an address this machine does not have
        raise CliError(f"cannot serve on {args.metrics_host}:{args.metrics_port}: {e}") from None
