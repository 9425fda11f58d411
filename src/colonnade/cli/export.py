"""`colonnade export`: a published version of a run as a Hugging Face model folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DESCRIPTION = (
    "Write a published version of a run (default: the newest) as a Hugging Face model "
    "folder: config.json, the tokenizer and the generation config as the trainer published "
    "them, and model.safetensors. The version is rebuilt as a worker rebuilds it: the newest "
    "anchor at or below it and the PULSE patches after it, each checked against the hashes "
    "the trainer signed. The weights are those the workers run (int8 codes and row scales, "
    "or bf16, as the run publishes), dequantized to the dtype config.json names (bf16 where "
    "it names none): not the trainer's fp32 masters, and within the published precision of "
    "them. The folder loads with transformers' AutoModelForCausalLM.from_pretrained(DIR) "
    "and `colonnade eval --model DIR`. A version trained with LoRA has its adapters merged "
    "into the weights they adapt; --adapter writes instead the adapters alone, as a PEFT "
    "adapter folder (adapter_model.safetensors and adapter_config.json, lora_alpha = r: "
    "the published B holds the scale), to load over the base model the run started from. "
    "It is written beside DIR and renamed into place: "
    "never half written. The trainer's retention keeps the versions from the previous "
    "anchor on (all of them with retain_all)."
)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        usage="colonnade export STORE[@vN] -o DIR [--adapter] [--force] [--trust KEY]",
        help="write a published version as a Hugging Face model folder (dequantized)",
        description=DESCRIPTION,
    )
    p.add_argument(
        "store",
        metavar="STORE[@vN]",
        help="the run's store (a folder, file:// or s3://bucket/prefix; a run directory "
        "too), with @vN for version N",
    )
    p.add_argument("-o", "--out", type=Path, required=True, metavar="DIR", help="folder to write")
    p.add_argument("--force", action="store_true", help="replace DIR if it holds anything")
    p.add_argument(
        "--adapter",
        action="store_true",
        help="write the version's LoRA adapters alone, as a PEFT adapter folder (an error "
        "for a version without adapters)",
    )
    p.add_argument(
        "--trust",
        help="the trainer's key: its .pub/.key file or fingerprint (SHA256:...); default "
        "the key that signed run.json",
    )
    p.add_argument("--endpoint-url", help="S3 endpoint (R2, MinIO, SeaweedFS)")
    p.add_argument("--profile", help="credentials profile for the store (s3://)")
    p.set_defaults(handler=_export)


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def trusted(value: str | None) -> str | None:
    """A --trust value as the fingerprint to pin (None: run.json's own key)."""
    from colonnade.protocol.signing import trusted_fingerprint

    from .main import CliError

    if value is None:
        return None
    try:
        return trusted_fingerprint(value)
    except ValueError as e:
        raise CliError(str(e)) from None


def read_errors() -> tuple[type[Exception], ...]:
    """What reading a version can fail with, each one line for the user: no
    run or version (ValueError), a document or payload that does not verify
    (SchemaError, PatchError: ValueErrors too; VersionError), a store that
    answers badly (StoreError)."""
    from colonnade.protocol import VersionError
    from colonnade.store import StoreError

    return (ValueError, VersionError, StoreError)


def _export(args: argparse.Namespace) -> int:
    from colonnade.operate.export import Ref, check_target, export_version, store_at

    from .main import CliError

    ref = Ref.parse(args.store)
    fingerprint = trusted(args.trust)
    try:
        check_target(args.out, args.force)  # before anything is read
        store = store_at(ref.url, args.endpoint_url, args.profile)
        done = export_version(
            store,
            ref.version,
            args.out,
            trusted=fingerprint,
            force=args.force,
            adapter=args.adapter,
            say=say,
        )
    except read_errors() as e:
        raise CliError(str(e)) from None
    what = "adapter" if done.adapter else done.dtype
    say(f"v{done.version} written ({what}): {done.path}")
    print(done.path)
    return 0


def published_engine(args: argparse.Namespace):
    """(engine, run spec) of `--model STORE@vN`: the version rebuilt as a
    worker rebuilds it, run at its run's published precision (`eval`,
    `serve`); `args` carries trust, endpoint_url, profile, precision,
    engine and device."""
    from colonnade.launch.evaluation import version_engine
    from colonnade.operate.export import Ref, open_view, store_at

    from .main import CliError

    ref = Ref.parse(args.model)
    fingerprint = trusted(args.trust)
    store = store_at(ref.url, args.endpoint_url, args.profile)
    spec = open_view(store, fingerprint).spec
    if args.precision not in (None, spec.precision):
        raise CliError(
            f"{args.model} runs at its run's published precision ({spec.precision}): "
            "leave out --precision"
        )
    return version_engine(store, ref.version, args.engine, args.device, fingerprint, say), spec


def store_flags(p) -> None:
    """The flags that reach a run's store and pin its trainer: --trust,
    --endpoint-url, --profile (`p`: a parser or an argument group)."""
    p.add_argument(
        "--trust",
        metavar="KEY",
        help="the trainer's key: its .pub/.key file or fingerprint (default: run.json's own)",
    )
    p.add_argument("--endpoint-url", help="S3 endpoint (R2, MinIO, SeaweedFS)")
    p.add_argument("--profile", help="credentials profile for the store (s3://)")


def published_flags(p: argparse.ArgumentParser) -> None:
    """The flags that reach a published version's store (`--model STORE@vN`)."""
    store_flags(p.add_argument_group("a published version (--model STORE@vN)"))
