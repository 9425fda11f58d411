"""Coding the new bits of changed elements, given their old bits.

Two exact transforms (never a float difference):
- "xor": new XOR old;
- "delta": zigzag of key(new) − key(old), key order-preserving, so a move of
  one ulp is ±1 and costs about a bit where its XOR is a carry chain.
Three layouts of the resulting nonzero integers:
- "planes": little-endian byte planes, zstd;
- "sym2": each value v ≥ 1 as a 2-bit symbol min(v−1, 3), four to a byte,
  zstd; values ≥ 4 also go, minus 4, to an escape stream in byte planes.
  Four symbols per byte let zstd's byte-wise Huffman stage spend under one
  bit on a symbol, which it cannot do for a byte per symbol.
- "rc": the context-adaptive range coder (rangecoder.py), by context class;
  close to the per-class entropy. Needs numba to encode at speed.
The encoder keeps the smallest combination it tries per tensor (see _candidates).
"""

from __future__ import annotations

import numpy as np

from . import bitcodes, kernels, rangecoder
from .positions import compress, decompress
from .tensors import FLOAT_DTYPES, SIGNED_INT_DTYPES

ZSTD_LEVEL = 3


def key_kind(dtype: str) -> int:
    """The kernels' KEY_* of a dtype's order-preserving key."""
    if dtype in FLOAT_DTYPES:
        return kernels.KEY_FLOAT
    return kernels.KEY_SIGNED if dtype in SIGNED_INT_DTYPES else kernels.KEY_UNSIGNED


def _key(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bitcodes.ordered_key(bits, dtype in FLOAT_DTYPES, dtype in SIGNED_INT_DTYPES)


def _sym2(values: np.ndarray) -> list[bytes]:
    sym = np.minimum(values - values.dtype.type(1), 3).astype(np.uint8)
    sym = np.concatenate([sym, np.zeros(-sym.size % 4, np.uint8)]).reshape(-1, 4)
    packed = (sym[:, 0] << 6) | (sym[:, 1] << 4) | (sym[:, 2] << 2) | sym[:, 3]
    escapes = values[values >= 4] - values.dtype.type(4)
    return [_z(packed.tobytes()), _z(bitcodes.byte_planes(escapes))]


def _z(data: bytes) -> bytes:
    return compress(data, ZSTD_LEVEL)


def _rc(values: np.ndarray, classes: np.ndarray) -> list[bytes]:
    escapes = values[values >= rangecoder.ESCAPE] - values.dtype.type(rangecoder.ESCAPE)
    return [rangecoder.encode_values(values, classes), _z(bitcodes.byte_planes(escapes))]


class ResidualParts:
    """The two residual transforms of one tensor's changes, gathered chunk by chunk.

    Only the transforms are kept (the old and new bits of a chunk's changes
    are dropped once transformed), so an encoder holds two small integers per
    changed element, not index arrays. They go into two arrays sized for the
    whole tensor but touched only as far as they are filled: untouched pages
    take no memory, and one mapping per array (rather than a piece per chunk
    among the chunks' temporaries) lets the allocator give those back.
    """

    def __init__(self, dtype: str, ut: type, capacity: int) -> None:
        self.dtype, self.ut = dtype, ut
        self._xor = np.empty(capacity, ut)
        self._delta = np.empty(capacity, ut)
        self.size = 0

    def add(self, old: np.ndarray, new: np.ndarray) -> None:
        self.extend(*kernels.residual_transforms(old, new, key_kind(self.dtype)))

    def extend(self, xor: np.ndarray, delta: np.ndarray) -> None:
        """Append transforms already computed (by the element pass)."""
        end = self.size + xor.size
        self._xor[self.size : end] = xor
        self._delta[self.size : end] = delta
        self.size = end

    def encode(self, classes: np.ndarray) -> tuple[str, str, list[bytes]]:
        """(transform, layout, blocks) of the smallest coding tried (see _candidates)."""
        return min(self._candidates(classes), key=lambda c: sum(map(len, c[2])))

    def _candidates(self, classes):
        """(transform, layout, blocks) worth trying, lazily.

        With the compiled range coder, the key delta in `rc` wins on every
        optimizer step we measured; XOR planes stay as the fallback for changes
        that are not small moves (new random values, flipped bits), and are
        only tried where `rc` spends over half the raw bytes: on the SmolLM2
        steps of docs/benchmarks.md they won only for tensors of a few
        changes (the range coder's flush dominates there), while trying them
        everywhere cost a noticeable share of an encode. Without the
        compiled coder, the zstd layouts of both transforms compete.
        """
        xor, delta = self._xor[: self.size], self._delta[: self.size]
        if rangecoder.COMPILED:
            rc = _rc(delta, classes)
            if 2 * sum(map(len, rc)) > xor.nbytes:
                yield "xor", "planes", [_z(bitcodes.byte_planes(xor))]
            yield "delta", "rc", rc
            return
        yield "xor", "planes", [_z(bitcodes.byte_planes(xor))]
        yield "delta", "planes", [_z(bitcodes.byte_planes(delta))]
        yield "delta", "sym2", _sym2(delta)
        yield "xor", "sym2", _sym2(xor)


def _unsym2(blocks: list[memoryview], count: int, ut: type) -> np.ndarray:
    packed = np.frombuffer(decompress(bytes(blocks[0]), -(-count // 4)), dtype=np.uint8)
    if packed.size != -(-count // 4):
        raise ValueError("residual symbols have the wrong length")
    sym = np.stack([packed >> 6, (packed >> 4) & 3, (packed >> 2) & 3, packed & 3], axis=1)
    values = sym.ravel()[:count].astype(ut) + ut(1)
    esc = values == 4
    n_esc = int(esc.sum())
    size = np.dtype(ut).itemsize
    raw = decompress(bytes(blocks[1]), n_esc * size)
    values[esc] += bitcodes.from_byte_planes(raw, n_esc, size).astype(ut)
    return values


def _unrc(blocks: list[memoryview], classes: np.ndarray, ut: type) -> np.ndarray:
    # Decoded straight into ut and the escapes added in one compiled pass:
    # the numpy passes (a cast, a mask, a masked add) were a fifth of it.
    values = rangecoder.decode_values(bytes(blocks[0]), classes, ut)
    n_esc = rangecoder.count_escapes(values)
    size = np.dtype(ut).itemsize
    raw = decompress(bytes(blocks[1]), n_esc * size)
    rangecoder.add_escapes(values, bitcodes.from_byte_planes(raw, n_esc, size))
    return values


def decode_values(
    entry: dict, blocks: list[memoryview], classes: np.ndarray, count: int, ut: type
) -> np.ndarray:
    """The `count` coded residual values (classes: each one's context class)."""
    if entry["rlayout"] == "rc":
        return _unrc(blocks, classes, ut)
    if entry["rlayout"] == "sym2":
        return _unsym2(blocks, count, ut)
    size = np.dtype(ut).itemsize
    raw = decompress(bytes(blocks[0]), count * size)
    return bitcodes.from_byte_planes(raw, count, size).astype(ut, copy=False)


def rebuild(entry: dict, old: np.ndarray, values: np.ndarray) -> np.ndarray:
    """New bits of the changed elements whose old bits are `old`."""
    res = kernels.RES_XOR if entry["res"] == "xor" else kernels.RES_DELTA
    return kernels.rebuild_values(old, values, res, key_kind(entry["dtype"]))
