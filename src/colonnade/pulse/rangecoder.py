"""An adaptive binary range coder for residual symbols, by context class.

Residual values are small (a changed weight mostly moved by one or two ulps)
and their distribution depends on the element's context class: small
magnitudes move by more ulps. zstd's byte-wise Huffman stage cannot spend
under a bit on a symbol nor switch tables by class; this coder does both, and
needs no tables in the stream: each (class, step) probability starts at 1/2
and adapts as symbols go by, identically on both sides.

The coder is LZMA's (carry propagation through a cached byte) with 12-bit
probabilities from Krichevsky-Trofimov counts per context, halved past 8192
so that old statistics fade slowly. A value v ≥ 1 is sent as a chain of
binary decisions "v − 1 == j?" for j = 0..14, each with its own probability
per class; v ≥ 16 leaves the chain and v − 16 goes to an escape stream.

The loops are plain Python in numba's subset: compiled by numba where it is
installed, run as they are otherwise (slow but exact: same bytes).
"""

from __future__ import annotations

import os

import numpy as np

N_CLASSES = 16
CHAIN = 15  # decisions per value before the escape
_BITS = 12
_ONE = 1 << _BITS
_LIMIT = 1 << 13  # counts are halved past this: old statistics fade slowly
_TOP = 1 << 24


def _p0(counts, c, j):
    # Krichevsky-Trofimov estimate of P(stop at j), in 12 bits, never 0 or 1.
    n0 = counts[c, j, 0]
    n1 = counts[c, j, 1]
    p = ((2 * n0 + 1) << _BITS) // (2 * (n0 + n1) + 2)
    return min(max(p, 1), _ONE - 1)


def _update(counts, c, j, bit):
    counts[c, j, bit] += 1
    if counts[c, j, 0] + counts[c, j, 1] > _LIMIT:
        counts[c, j, 0] = (counts[c, j, 0] + 1) >> 1
        counts[c, j, 1] = (counts[c, j, 1] + 1) >> 1


def _encode(values, classes, out):  # values: uint64 ≥ 1; returns bytes written
    counts = np.zeros((N_CLASSES, CHAIN, 2), np.int64)
    low = 0
    rng = 0xFFFFFFFF
    cache = 0
    cache_size = 1
    pos = 0
    for i in range(values.size):
        c = classes[i]
        target = values[i] - 1
        for j in range(CHAIN):
            bound = (rng >> _BITS) * _p0(counts, c, j)
            if target == j:  # bit 0: stop here
                rng = bound
                _update(counts, c, j, 0)
            else:
                low += bound
                rng -= bound
                _update(counts, c, j, 1)
            while rng < _TOP:
                rng = (rng << 8) & 0xFFFFFFFF
                if low < 0xFF000000 or low >= 0x100000000:
                    carry = low >> 32
                    temp = cache
                    while cache_size > 0:
                        out[pos] = (temp + carry) & 0xFF
                        pos += 1
                        temp = 0xFF
                        cache_size -= 1
                    cache = (low >> 24) & 0xFF
                cache_size += 1
                low = (low & 0x00FFFFFF) << 8
            if target == j:
                break
    for _ in range(5):
        if low < 0xFF000000 or low >= 0x100000000:
            carry = low >> 32
            temp = cache
            while cache_size > 0:
                out[pos] = (temp + carry) & 0xFF
                pos += 1
                temp = 0xFF
                cache_size -= 1
            cache = (low >> 24) & 0xFF
        cache_size += 1
        low = (low & 0x00FFFFFF) << 8
    return pos


def _decode(data, classes, out):  # fills out (uint64); returns bytes read, or -1
    counts = np.zeros((N_CLASSES, CHAIN, 2), np.int64)
    if data.size < 5:
        return -1
    rng = 0xFFFFFFFF
    code = 0
    pos = 0
    for _ in range(5):
        code = (code << 8) | int(data[pos])
        pos += 1
    for i in range(out.size):
        c = classes[i]
        j = 0
        while j < CHAIN:
            bound = (rng >> _BITS) * _p0(counts, c, j)
            if code < bound:
                rng = bound
                _update(counts, c, j, 0)
                stop = True
            else:
                code -= bound
                rng -= bound
                _update(counts, c, j, 1)
                stop = False
            while rng < _TOP:
                if pos >= data.size:
                    return -1
                rng = (rng << 8) & 0xFFFFFFFF
                code = ((code << 8) | int(data[pos])) & 0xFFFFFFFF
                pos += 1
            if stop:
                break
            j += 1
        out[i] = j + 1  # j == CHAIN means "escape": the caller adds the rest
    return pos


def _compile():
    if os.environ.get("COLONNADE_NO_NUMBA") == "1":
        return _encode, _decode
    try:
        import numba
    except ImportError:
        return _encode, _decode
    global _p0, _update
    _p0 = numba.njit(cache=True, inline="always")(_p0)
    _update = numba.njit(cache=True, inline="always")(_update)
    return (
        numba.njit(cache=True, nogil=True)(_encode),
        numba.njit(cache=True, nogil=True)(_decode),
    )


_ENC, _DEC = _compile()
COMPILED = _ENC is not _encode


def encode(values: np.ndarray, classes: np.ndarray) -> bytes:
    """Range-coded chain decisions of values (≥ 1); values ≥ 16 continue in an escape."""
    v = values.astype(np.uint64, copy=False)
    out = np.empty(v.size * 4 + 64, np.uint8)  # ≤ 15 decisions × ≤ 11 bits, seldom more
    if v.size and int(v.min()) < 1:
        raise ValueError("range coder values must be ≥ 1")
    try:
        n = _ENC(v, classes.astype(np.int64, copy=False), out)
    except IndexError:  # only if pathological input outran the buffer
        out = np.empty(v.size * 24 + 64, np.uint8)
        n = _ENC(v, classes.astype(np.int64, copy=False), out)
    return out[:n].tobytes()


def decode(data: bytes, classes: np.ndarray) -> np.ndarray:
    """Values (1..16; 16 = escape) of `classes.size` symbols; ValueError if short."""
    out = np.empty(classes.size, np.uint64)
    buf = np.frombuffer(data, np.uint8)
    used = _DEC(buf, classes.astype(np.int64, copy=False), out)
    if used < 0:
        raise ValueError("range-coded residuals end early")
    return out
