"""`colonnade tools serve`: an environment's tool behind HTTP, every reply signed."""

from __future__ import annotations

import argparse
import sys
import threading
from pathlib import Path

from .envargs import add_env_arg, env_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("tools", help="tool services: an environment's tool served over HTTP")
    tsub = t.add_subparsers(dest="tools_command", metavar="ACTION", required=True)
    s = tsub.add_parser(
        "serve",
        help="serve an environment's tool, signing every reply",
        description="Build the environment (with its data: for searchqa the corpus and its "
        "index) and answer its tool's calls on POST /v1/call, each reply signed by --key "
        "(make one with `colonnade keys new --id tools`). A run uses the service with "
        "--env-arg service=URL --env-arg service_key=HEX (printed at start): its workers "
        "then hold none of the data, and the trainer checks the signatures. See "
        "docs/environments.md.",
    )
    s.add_argument("--env", required=True, help="environment name or import path")
    add_env_arg(s)
    s.add_argument("--key", type=Path, required=True, help="the service's private key file")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8200, help="port (default 8200; 0: any free one)")
    slow = s.add_argument_group("rehearsing a slow service")
    slow.add_argument(
        "--latency-ms", type=float, default=0.0, help="wait this long before every reply"
    )
    slow.add_argument(
        "--tail-ms", type=float, default=0.0, help="wait this long instead for --tail-share"
    )
    slow.add_argument(
        "--tail-share",
        type=float,
        default=0.0,
        help="the share of calls (picked by the call's hash) that wait --tail-ms",
    )
    s.set_defaults(handler=_serve)


def _serve(args: argparse.Namespace) -> int:
    from colonnade.envs import load_environment
    from colonnade.protocol.signing import load_private
    from colonnade.tools.service import Latency, ToolService

    from .main import CliError

    kwargs = env_kwargs(args) or {}
    if kwargs.get("service"):
        raise CliError("the environment to serve answers its tool itself: drop service=")
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port {args.port}: 0 to 65535")
    try:
        latency = Latency(args.latency_ms / 1e3, args.tail_ms / 1e3, args.tail_share)
    except ValueError as e:
        raise CliError(f"--latency-ms, --tail-ms, --tail-share: {e}") from None
    try:
        _, private = load_private(args.key)
    except ValueError as e:
        raise CliError(str(e)) from None
    print(f"building {args.env} ...", file=sys.stderr, flush=True)
    try:
        env = load_environment(args.env, **kwargs)
    except (ValueError, TypeError) as e:
        raise CliError(str(e)) from None
    if not callable(getattr(env, "tool_result", None)):
        raise CliError(f"environment {args.env} has no tool_result(query): nothing to serve")
    try:
        service = ToolService(env.tool_result, private, args.host, args.port, latency).start()
    except OSError as e:
        raise CliError(f"cannot listen on {args.host}:{args.port}: {e}") from None
    print(f"serving {args.env}'s tool on {service.url}", file=sys.stderr)
    print(f"a run uses it with: --env-arg service={service.url} "
          f"--env-arg service_key={service.public_hex}", file=sys.stderr, flush=True)  # fmt: skip
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        service.close()
    return 0
