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
# The estimate's division, (2·n0 + 1)·2^12 // (2·(n0 + n1) + 2), as a
# multiply by a rounded-up reciprocal and a shift: exact while
# numerator · divisor ≤ 2^_SHIFT (at most 2^40 here, counts being ≤ _LIMIT + 1),
# and the products stay under 2^55. A table look-up and a multiply ran the
# coder faster than the 64-bit division in both directions (docs/benchmarks.md).
_SHIFT = 42
_RECIP = np.array([0] + [-(-(1 << _SHIFT) // d) for d in range(1, 2 * (_LIMIT + 1) + 3)], np.int64)

# The loops below are written out in full, with scalar state: numba's inlined
# helpers taking arrays paid reference counting per call (many times slower). The
# decoder's one helper, `_learn`, updates a context after its decision: each
# context's probability is kept ready in `prob`, so the division that makes
# it is paid after a decision, where it overlaps the next, not before it (the
# decoder waits on every decision; the encoder knows them all and did not
# gain: docs/benchmarks.md). Both compute the same probabilities.


def _learn(counts, prob, k, stop, recip):
    n0 = counts[k, 0] + (1 if stop else 0)
    n1 = counts[k, 1] + (0 if stop else 1)
    if n0 + n1 > _LIMIT:  # old statistics fade
        n0 = (n0 + 1) >> 1
        n1 = (n1 + 1) >> 1
    counts[k, 0] = n0
    counts[k, 1] = n1
    # Krichevsky-Trofimov estimate of P(stop), 12 bits, never 0 or 1.
    prob[k] = min(max((((2 * n0 + 1) << _BITS) * recip[2 * (n0 + n1) + 2]) >> _SHIFT, 1), _ONE - 1)


def _encode_values(values, classes, out, recip):
    counts = np.zeros((N_CLASSES * CHAIN, 2), np.int64)
    low = 0
    rng = 0xFFFFFFFF
    cache = 0
    cache_size = 1
    pos = 0
    for i in range(values.size + 5):  # the last 5 rounds flush `low`
        if i < values.size:
            target = values[i] - 1
            base = classes[i] * CHAIN
            for j in range(CHAIN):
                k = base + j
                n0 = counts[k, 0]
                n1 = counts[k, 1]
                p0 = (((2 * n0 + 1) << _BITS) * recip[2 * (n0 + n1) + 2]) >> _SHIFT
                p0 = min(max(p0, 1), _ONE - 1)
                bound = (rng >> _BITS) * p0
                stop = target == j
                if stop:
                    rng = bound
                    counts[k, 0] = n0 + 1
                else:
                    low += bound
                    rng -= bound
                    counts[k, 1] = n1 + 1
                if n0 + n1 + 1 > _LIMIT:
                    counts[k, 0] = (counts[k, 0] + 1) >> 1
                    counts[k, 1] = (counts[k, 1] + 1) >> 1
                while rng < _TOP:
                    rng = (rng << 8) & 0xFFFFFFFF
                    if low < 0xFF000000 or low >= 0x100000000:
                        carry = low >> 32
                        temp = cache
                        while cache_size > 0:
                            if pos >= out.size:
                                return -1
                            out[pos] = (temp + carry) & 0xFF
                            pos += 1
                            temp = 0xFF
                            cache_size -= 1
                        cache = (low >> 24) & 0xFF
                    cache_size += 1
                    low = (low & 0x00FFFFFF) << 8
                if stop:
                    break
        else:
            if low < 0xFF000000 or low >= 0x100000000:
                carry = low >> 32
                temp = cache
                while cache_size > 0:
                    if pos >= out.size:
                        return -1
                    out[pos] = (temp + carry) & 0xFF
                    pos += 1
                    temp = 0xFF
                    cache_size -= 1
                cache = (low >> 24) & 0xFF
            cache_size += 1
            low = (low & 0x00FFFFFF) << 8
    return pos


def _decode_values(data, classes, out, recip):
    # Fills out with values 1..16 (16: an escape, the caller adds the rest);
    # returns the bytes read, or -1 if the stream ends early.
    counts = np.zeros((N_CLASSES * CHAIN, 2), np.int64)
    prob = np.full(N_CLASSES * CHAIN, _ONE // 2, np.int64)
    if data.size < 5:
        return -1
    rng = 0xFFFFFFFF
    code = 0
    for k in range(5):
        code = (code << 8) | int(data[k])
    pos = 5
    for i in range(out.size):
        base = classes[i] * CHAIN
        j = 0
        while j < CHAIN:
            k = base + j
            bound = (rng >> _BITS) * prob[k]
            stop = code < bound
            if stop:
                rng = bound
            else:
                code -= bound
                rng -= bound
            _learn(counts, prob, k, stop, recip)
            while rng < _TOP:
                if pos >= data.size:
                    return -1
                rng = (rng << 8) & 0xFFFFFFFF
                code = ((code << 8) | int(data[pos])) & 0xFFFFFFFF
                pos += 1
            if stop:
                break
            j += 1
        out[i] = j + 1
    return pos


def _count_escapes(values, escape):
    n = 0
    for i in range(values.size):
        if values[i] == escape:
            n += 1
    return n


def _add_escapes(values, rest, escape):
    # Each escaped value gets the next of `rest` (what it holds beyond the
    # chain); returns how many, or -1 where `rest` runs out first.
    j = 0
    for i in range(values.size):
        if values[i] == escape:
            if j >= rest.size:
                return -1
            values[i] += rest[j]
            j += 1
    return j


def _compile():
    fns = (_encode_values, _decode_values, _count_escapes, _add_escapes)
    if os.environ.get("COLONNADE_NO_NUMBA") == "1":
        return fns
    try:
        import numba
    except ImportError:
        return fns
    jit = numba.njit(cache=True, nogil=True)
    globals()["_learn"] = jit(_learn)  # the loops call it by this module global
    return tuple(jit(f) for f in fns)


_ENC_V, _DEC_V, _COUNT_ESC, _ADD_ESC = _compile()
COMPILED = _ENC_V is not _encode_values


def encode_values(values: np.ndarray, classes: np.ndarray) -> bytes:
    """Range-coded residual values (≥ 1); values ≥ 16 need an escape stream too."""
    if values.size and int(values.min()) < 1:
        raise ValueError("range coder values must be ≥ 1")
    # uint64 would mix with int64 into floats inside the loop; a wrapped huge
    # value is negative, never matches a decision, and leaves by the escape.
    v = values.view(np.int64) if values.dtype == np.uint64 else values
    cls = classes.astype(np.uint8, copy=False)
    # Output is typically well under a byte per value; start small (memory)
    # and retry with the hard bound (15 decisions of ≤ 12 bits: 23 bytes).
    for per_value in (1, 23):
        out = np.empty(v.size * per_value + 64, np.uint8)
        n = _ENC_V(v, cls, out, _RECIP)
        if n >= 0:
            return out[:n].tobytes()
    raise AssertionError("range coder overran its hard bound")


def decode_values(data: bytes, classes: np.ndarray, dtype=np.uint8) -> np.ndarray:
    """Values (1..16; 16 = escape) of `classes.size` symbols, as `dtype`
    (where escapes will be added: `add_escapes`); ValueError if short."""
    out = np.empty(classes.size, dtype)
    cls = classes.astype(np.uint8, copy=False)
    used = _DEC_V(np.frombuffer(data, np.uint8), cls, out, _RECIP)
    if used < 0:
        raise ValueError("range-coded residuals end early")
    return out


ESCAPE = CHAIN + 1  # a decoded value that left the chain


def count_escapes(values: np.ndarray) -> int:
    return int(_COUNT_ESC(values, values.dtype.type(ESCAPE)))


def add_escapes(values: np.ndarray, rest: np.ndarray) -> None:
    """Add to each escaped value, in order, what it holds beyond the chain
    (`rest`, of values' dtype, one per escape: count_escapes)."""
    if rest.dtype != values.dtype:
        raise TypeError(f"escapes are {rest.dtype}, values {values.dtype}")
    if _ADD_ESC(values, rest, values.dtype.type(ESCAPE)) != rest.size:
        raise ValueError(f"{rest.size} residual escapes do not match the escaped values")
