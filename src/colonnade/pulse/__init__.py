"""PULSE weight patches: send only what changed, rebuild it bit for bit.

Public API:
    encode(old, new, precision=...) -> (patch bytes, PatchStats)
    diff(old, new, precision=...)   -> patch bytes
    apply(base, patch)              -> new state (checked by its state hash;
                                       in_place=True rebuilds inside the base)
    prepare(state, precision)       -> the state a receiver holds at a precision
    quantize_state / dequantize_state / quantize_rows: the int8 quantizer
    state_hash(state, algo)         -> "blake3:<hex>" (or "sha256:…"): a per-tensor tree hash
    PatchError                      -> every way a patch can be bad
"""

from .codec import PatchStats, diff, encode, prepare
from .decode import apply, read_header
from .errors import PatchError
from .hashing import ALGOS as HASHES
from .hashing import digest_bytes, digest_file, state_hash
from .quant import (
    SCALE_SUFFIX,
    dequantize_rows,
    dequantize_state,
    published_value,
    quantize_rows,
    quantize_state,
)

__all__ = [
    "HASHES",
    "SCALE_SUFFIX",
    "PatchError",
    "PatchStats",
    "apply",
    "dequantize_rows",
    "dequantize_state",
    "diff",
    "digest_bytes",
    "digest_file",
    "encode",
    "prepare",
    "published_value",
    "quantize_rows",
    "quantize_state",
    "read_header",
    "state_hash",
]
