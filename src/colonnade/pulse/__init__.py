"""PULSE weight patches: send only what changed, rebuild it bit for bit.

Public API:
    encode(old, new, precision=...) -> (patch bytes, PatchStats)
    diff(old, new, precision=...)   -> patch bytes
    apply(base, patch)              -> new state (checked by SHA-256)
    prepare(state, precision)       -> the state a receiver holds at a precision
    quantize_state / dequantize_state / quantize_rows: the int8 quantizer
    state_sha256(state)             -> hex digest of a state
    PatchError                      -> every way a patch can be bad
"""

from .codec import PatchStats, diff, encode, prepare
from .decode import apply, read_header
from .errors import PatchError
from .quant import SCALE_SUFFIX, dequantize_rows, dequantize_state, quantize_rows, quantize_state
from .tensors import state_sha256

__all__ = [
    "SCALE_SUFFIX",
    "PatchError",
    "PatchStats",
    "apply",
    "dequantize_rows",
    "dequantize_state",
    "diff",
    "encode",
    "prepare",
    "quantize_rows",
    "quantize_state",
    "read_header",
    "state_sha256",
]
