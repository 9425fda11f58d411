"""`colonnade invite`: the join string an operator hands each worker."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "invite",
        usage="colonnade invite --store URL [--endpoint-url URL] [--key FILE|FINGERPRINT] "
        "[--inbox URL] [--env NAME]",
        help="print the join string workers start with (colonnade worker --join)",
        description="Print one line, the join string of a run: its store and S3 endpoint, "
        "the inbox where workers write, the fingerprint of the trainer's key and the "
        "environment. They are read from the run's signed run.json once the trainer has "
        "written it (a value given that differs is refused); before that, --key and --env "
        "are needed. The string holds no secret: each worker takes its credentials from its "
        "own environment or AWS profile and runs `colonnade worker --join STRING --key "
        "its.key`.",
    )
    p.add_argument("--store", required=True, help="the run's store: s3://bucket/prefix")
    p.add_argument(
        "--endpoint-url",
        "--endpoint",
        dest="endpoint_url",
        metavar="URL",
        help="S3 endpoint of the store as workers reach it (R2, MinIO); default "
        "$AWS_ENDPOINT_URL_S3 or $AWS_ENDPOINT_URL, else AWS",
    )
    p.add_argument(
        "--profile", help="credentials profile to read run.json with (not in the string)"
    )
    p.add_argument(
        "--key",
        default="",
        metavar="FILE|FINGERPRINT",
        help="the trainer's key: its .pub file, its .key file (only the public half is "
        "read) or its fingerprint; checked against the key that signed run.json",
    )
    p.add_argument("--inbox", metavar="URL", help="where workers write (as the trainer's --inbox)")
    p.add_argument(
        "--inbox-endpoint-url", metavar="URL", help="the inbox's S3 endpoint, where it differs"
    )
    p.add_argument("--env", help="the run's environment (read from run.json when it exists)")
    p.set_defaults(handler=_invite)


def _invite(args: argparse.Namespace) -> int:
    from colonnade.operate.join import make_invite
    from colonnade.store import StoreError

    from .main import CliError

    try:
        invite = make_invite(
            args.store,
            endpoint=args.endpoint_url,
            profile=args.profile,
            key=args.key,
            inbox=args.inbox,
            inbox_endpoint=args.inbox_endpoint_url,
            env=args.env,
        )
    except (ValueError, StoreError) as e:
        raise CliError(str(e)) from None
    print(invite.encode())
    print(f"join string of the {invite.describe()}", file=sys.stderr)
    print("on each worker: colonnade worker --join STRING --key KEY.key", file=sys.stderr)
    return 0
