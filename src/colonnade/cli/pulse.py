"""`colonnade pulse diff|apply`: PULSE patches between safetensors files."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "pulse",
        help="make and apply PULSE weight patches",
        description="Make and apply PULSE weight patches between "
        ".safetensors checkpoints. Lossless, checked by a state hash (BLAKE3 by default).",
    )
    psub = p.add_subparsers(dest="pulse", metavar="ACTION", required=True)
    d = psub.add_parser(
        "diff",
        help="write the patch that turns OLD into NEW",
        description="Write the patch that turns OLD into NEW.",
    )
    d.add_argument("old", type=Path, help="base checkpoint (.safetensors)")
    d.add_argument("new", type=Path, help="new checkpoint (.safetensors)")
    d.add_argument("-o", "--output", type=Path, required=True, help="patch file to write")
    d.add_argument(
        "--precision",
        choices=["bf16", "int8", "exact"],
        default="bf16",
        help="bf16: float tensors rounded to bf16 (default); int8: 2-D weights as "
        "per-row int8 codes + scales (what workers run); exact: dtypes as stored",
    )
    d.add_argument(
        "--hash",
        choices=["blake3", "sha256"],
        default="blake3",
        help="state hash algorithm (default blake3; sha256 where it is required)",
    )
    d.add_argument("--json", action="store_true", help="print statistics as JSON")
    d.set_defaults(handler=_diff)
    a = psub.add_parser(
        "apply",
        help="rebuild the new checkpoint from BASE and PATCH",
        description="Rebuild the new checkpoint from BASE and PATCH; the "
        "result is verified against the state hash in the patch before "
        "anything is written.",
    )
    a.add_argument("base", type=Path, help="base checkpoint (.safetensors)")
    a.add_argument("patch", type=Path, help="patch file")
    a.add_argument("-o", "--output", type=Path, required=True, help="checkpoint to write")
    a.set_defaults(handler=_apply)


def _load(path: Path):
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    from .main import CliError

    if not path.is_file():
        raise CliError(f"{path}: no such file")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CliError(f"{path}: not a readable safetensors file ({e})") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write via a temp file in the same directory, so OUT is whole or absent."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _diff(args: argparse.Namespace) -> int:
    from colonnade.pulse import encode

    from .main import CliError

    old, new = _load(args.old), _load(args.new)
    try:
        patch, stats = encode(old, new, precision=args.precision, hash_algo=args.hash)
    except (TypeError, ValueError) as e:
        raise CliError(str(e)) from None
    write_atomic(args.output, patch)
    report = {
        "elements": stats.elements,
        "changed": stats.changed,
        "density": stats.density,
        "patch_bytes": stats.patch_bytes,
        "full_bytes": stats.full_bytes,
        "ratio": stats.ratio,
        "bits_per_changed": stats.bits_per_changed,
        "precision": stats.precision,
        "result_hash": stats.result_hash,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(
            f"{args.output}: {stats.patch_bytes:,} bytes for {stats.changed:,} of "
            f"{stats.elements:,} elements changed ({stats.density:.3%}); "
            f"{stats.ratio:.4f} of the full {stats.full_bytes:,} bytes, "
            f"{stats.bits_per_changed:.2f} bits per changed element",
            file=sys.stderr,
        )
    return 0


def _apply(args: argparse.Namespace) -> int:
    from safetensors.torch import save

    from colonnade.pulse import PatchError, apply, prepare, read_header

    from .main import CliError

    base = _load(args.base)
    if not args.patch.is_file():
        raise CliError(f"{args.patch}: no such file")
    data = args.patch.read_bytes()
    try:
        precision = str(read_header(data)["precision"])
        state = apply(prepare(base, precision), data)
    except (PatchError, ValueError) as e:
        raise CliError(f"{args.patch}: {e}") from None
    write_atomic(args.output, save({k: v.contiguous() for k, v in state.items()}))
    print(f"{args.output}: rebuilt and verified ({len(state)} tensors)", file=sys.stderr)
    return 0
