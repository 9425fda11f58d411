"""Raw-bit views of tensors and the dtype table of the format.

The codec works on the bit patterns of tensors, never on their float values,
so that every round trip is exact. This module owns the mapping between torch
tensors and flat unsigned numpy views of the same bytes.
"""

from __future__ import annotations

import numpy as np
import torch

# safetensors dtype names: the names on the wire and in the state hash.
DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
SIGNED_INT_DTYPES = frozenset({"I8", "I16", "I32", "I64"})

_UINT: dict[int, type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.uint16,
    4: np.uint32,
    8: np.uint64,
}
# torch has no unsigned 16/32/64 views everywhere; signed views share the bits.
_TORCH_INT: dict[int, torch.dtype] = {
    1: torch.uint8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}
_NP_INT: dict[int, type[np.signedinteger] | type[np.unsignedinteger]] = {
    1: np.uint8,
    2: np.int16,
    4: np.int32,
    8: np.int64,
}


def dtype_name(t: torch.Tensor) -> str:
    try:
        return DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"unsupported dtype {t.dtype}") from None


def itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


def uint_type(size: int) -> type[np.unsignedinteger]:
    return _UINT[size]


def to_bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned view of a tensor's bytes (copied only if it must be)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    flat = t.contiguous().reshape(-1)
    size = flat.element_size()
    return flat.view(_TORCH_INT[size]).numpy().view(_UINT[size])


def from_bits(bits: np.ndarray, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Tensor of `dtype` and `shape` whose bytes are `bits` (no copy)."""
    size = bits.dtype.itemsize
    arr = np.ascontiguousarray(bits).view(_NP_INT[size])
    return torch.from_numpy(arr).view(DTYPES[dtype]).reshape(shape)
