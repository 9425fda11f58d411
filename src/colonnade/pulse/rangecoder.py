"""An adaptive binary range coder for residual values, by context class.

Residual values are small (a changed weight mostly moved by one or two ulps)
and their distribution depends on the element's context class (small
magnitudes move by more ulps). zstd's byte-wise Huffman stage cannot spend under a
bit on a symbol nor switch tables by class; this coder does both and needs no
tables in the stream: each context's probability is estimated from counts of
what went by, identically on both sides.

The coder is LZMA's (carry propagation through a cached byte, 32-bit range
renormalised below 2^24, 5 flush bytes) with 12-bit probabilities:
Krichevsky-Trofimov estimates from per-context counts, halved past 8192 so
old statistics fade slowly. A value v ≥ 1 is sent as the decisions
"v − 1 == j?" for j = 0..14, context (class, j); v ≥ 16 leaves the chain and
v − 16 goes to an escape stream. (Position gaps coded the same way, with an
Elias-gamma binarisation, came out no smaller than the Rice code: Rice is
already near the entropy of geometric gaps, and was kept for its speed.)

The loops are plain Python in numba's subset: compiled by numba where it is
installed, run as they are otherwise (slow, same bytes).
"""

from __future__ import annotations

import os

import numpy as np

N_CLASSES = 16
CHAIN = 15  # decisions per residual value before the escape
_BITS = 12
_ONE = 1 << _BITS
_LIMIT = 1 << 13
_TOP = 1 << 24
# Encoder state slots: low, range, cache, cache_size, bytes written.
_LOW, _RNG, _CACHE, _CSIZE, _POS = range(5)


def _p0(counts, i):
    # Krichevsky-Trofimov estimate of P(bit = 0), in 12 bits, never 0 or 1.
    n0 = counts[i, 0]
    n1 = counts[i, 1]
    p = ((2 * n0 + 1) << _BITS) // (2 * (n0 + n1) + 2)
    return min(max(p, 1), _ONE - 1)


def _update(counts, i, bit):
    counts[i, bit] += 1
    if counts[i, 0] + counts[i, 1] > _LIMIT:
        counts[i, 0] = (counts[i, 0] + 1) >> 1
        counts[i, 1] = (counts[i, 1] + 1) >> 1


def _shift_low(st, out):
    low = st[_LOW]
    if low < 0xFF000000 or low >= 0x100000000:
        carry = low >> 32
        temp = st[_CACHE]
        while st[_CSIZE] > 0:
            out[st[_POS]] = (temp + carry) & 0xFF
            st[_POS] += 1
            temp = 0xFF
            st[_CSIZE] -= 1
        st[_CACHE] = (low >> 24) & 0xFF
    st[_CSIZE] += 1
    st[_LOW] = (low & 0x00FFFFFF) << 8


def _enc_bit(st, out, counts, i, bit):
    bound = (st[_RNG] >> _BITS) * _p0(counts, i)
    if bit == 0:
        st[_RNG] = bound
    else:
        st[_LOW] += bound
        st[_RNG] -= bound
    _update(counts, i, bit)
    while st[_RNG] < _TOP:
        st[_RNG] = (st[_RNG] << 8) & 0xFFFFFFFF
        _shift_low(st, out)


def _enc_state():
    st = np.zeros(5, np.int64)
    st[_RNG] = 0xFFFFFFFF
    st[_CSIZE] = 1
    return st


def _enc_flush(st, out):
    for _ in range(5):
        _shift_low(st, out)
    return st[_POS]


# Decoder state slots: range, code, bytes read, error flag.
_DRNG, _CODE, _DPOS, _ERR = range(4)


def _dec_state(data):
    st = np.zeros(4, np.int64)
    st[_DRNG] = 0xFFFFFFFF
    if data.size < 5:
        st[_ERR] = 1
        return st
    for k in range(5):
        st[_CODE] = (st[_CODE] << 8) | int(data[k])
    st[_DPOS] = 5
    return st


def _dec_bit(st, data, counts, i):
    bound = (st[_DRNG] >> _BITS) * _p0(counts, i)
    if st[_CODE] < bound:
        st[_DRNG] = bound
        bit = 0
    else:
        st[_CODE] -= bound
        st[_DRNG] -= bound
        bit = 1
    _update(counts, i, bit)
    while st[_DRNG] < _TOP:
        if st[_DPOS] >= data.size:
            st[_ERR] = 1
            return bit
        st[_DRNG] = (st[_DRNG] << 8) & 0xFFFFFFFF
        st[_CODE] = ((st[_CODE] << 8) | int(data[st[_DPOS]])) & 0xFFFFFFFF
        st[_DPOS] += 1
    return bit


def _encode_values(values, classes, out):
    counts = np.zeros((N_CLASSES * CHAIN, 2), np.int64)
    st = _enc_state()
    for i in range(values.size):
        target = values[i] - 1
        base = classes[i] * CHAIN
        for j in range(CHAIN):
            stop = target == j
            _enc_bit(st, out, counts, base + j, 0 if stop else 1)
            if stop:
                break
    return _enc_flush(st, out)


def _decode_values(data, classes, out):
    counts = np.zeros((N_CLASSES * CHAIN, 2), np.int64)
    st = _dec_state(data)
    for i in range(out.size):
        base = classes[i] * CHAIN
        j = 0
        while j < CHAIN:
            if _dec_bit(st, data, counts, base + j) == 0:
                break
            j += 1
        out[i] = j + 1  # j == CHAIN: an escape, the caller adds the rest
        if st[_ERR]:
            return -1
    return st[_DPOS]


def _compile():
    fns = (_encode_values, _decode_values)
    if os.environ.get("COLONNADE_NO_NUMBA") == "1":
        return fns
    try:
        import numba
    except ImportError:
        return fns
    g = globals()
    for name in (
        "_p0",
        "_update",
        "_shift_low",
        "_enc_bit",
        "_enc_state",
        "_enc_flush",
        "_dec_state",
        "_dec_bit",
    ):
        g[name] = numba.njit(cache=True, inline="always")(g[name])
    return tuple(numba.njit(cache=True, nogil=True)(f) for f in fns)


_ENC_V, _DEC_V = _compile()
COMPILED = _ENC_V is not _encode_values


def _run_encoder(fn, symbols: np.ndarray, classes: np.ndarray, per_symbol: int) -> bytes:
    out = np.empty(symbols.size * per_symbol + 64, np.uint8)
    n = fn(symbols.astype(np.uint64, copy=False), classes.astype(np.int64, copy=False), out)
    return out[:n].tobytes()


def encode_values(values: np.ndarray, classes: np.ndarray) -> bytes:
    """Range-coded residual values (≥ 1); values ≥ 16 need an escape stream too."""
    if values.size and int(values.min()) < 1:
        raise ValueError("range coder values must be ≥ 1")
    # ≤ 15 decisions of ≤ 12 bits each: 23 bytes is a hard bound per value.
    return _run_encoder(_ENC_V, values, classes, 23)


def decode_values(data: bytes, classes: np.ndarray) -> np.ndarray:
    """Values (1..16; 16 = escape) of `classes.size` symbols; ValueError if short."""
    out = np.empty(classes.size, np.uint64)
    used = _DEC_V(np.frombuffer(data, np.uint8), classes.astype(np.int64, copy=False), out)
    if used < 0:
        raise ValueError("range-coded residuals end early")
    return out
