"""The "rice" position code of one chunk in compiled loops (numba).

positions.RiceEncoder and positions.rice_chunks code a chunk's groups (one
per context class with changes) a few numpy calls at a time: per group its
gaps, the best Rice parameter, the unary and remainder bits. A model of a
few hundred tensors has thousands of such groups, and that per-group Python
cost was a large part of encoding and applying a patch (docs/benchmarks.md).
These kernels do a whole chunk in one call, writing (or reading) the packed
bit streams directly, and give exactly the bits of the numpy path
(bitcodes), which stays the reference and the fallback without numba.

The bit streams are MSB-first (np.packbits order), written into zeroed
buffers at a running bit position that carries over from chunk to chunk.
"""

from __future__ import annotations

import math
import os

import numpy as np

from .bitcodes import MAX_RICE_K
from .kernels import N_CLASSES

# Why a chunk's read failed (the decoder's return code when negative).
ERRORS = {
    -1: "group count out of range",
    -2: "unary stream ends early",
    -3: "remainder stream ends early",
    -4: "rank beyond its class",
    -10: "group table too short",
    -11: "group table has a partial row",
    -12: "group table has the wrong length",
    -13: "group table out of range",
    -14: "group table not in order",
    -15: "group table: invert is not 0 or 1",
}
_LN2 = math.log(2.0)
# Leading one bits (from the most significant) of each byte value.
_LEADING_ONES = np.array(
    [next((i for i in range(8) if not (b >> (7 - i)) & 1), 8) for b in range(256)], np.int64
)


def _best_k(g, n):  # pragma: no cover - compiled
    # bitcodes.best_rice_k: a guess from the mean, then the exact cost of
    # the parameters around it (first minimum). The sum is exact in int64,
    # so the mean is numpy's to the last bit.
    if n == 0:
        return 0
    s = 0
    for j in range(n):
        s += g[j]
    mean = s / n
    guess = 0
    if mean > 1:
        guess = max(0, math.floor(math.log2(mean * _LN2 + 1e-12)))
    best_k, best = 0, -1
    for k in range(max(0, guess - 1), min(MAX_RICE_K, guess + 2) + 1):
        cost = n * (1 + k)
        for j in range(n):
            cost += g[j] >> k
        if best < 0 or cost < best:
            best_k, best = k, cost
    return best_k


def _group_gaps(ranks, lo, m, size, invert, g):
    # Gaps of the coded ranks (the changed ones, or with invert the others)
    # into g; returns how many.
    n = 0
    prev = -1
    if invert:
        p = lo
        for r in range(size):
            if p < lo + m and ranks[p] == r:
                p += 1
            else:
                g[n] = r - prev - 1
                prev = r
                n += 1
    else:
        for j in range(lo, lo + m):
            g[n] = ranks[j] - prev - 1
            prev = ranks[j]
            n += 1
    return n


def _put(buf, pos, value, nbits):
    # The low nbits of value at bit pos, MSB first (buf zeroed past pos).
    while nbits > 0:
        space = 8 - (pos & 7)
        take = min(space, nbits)
        nbits -= take
        buf[pos >> 3] |= ((value >> nbits) & ((1 << take) - 1)) << (space - take)
        pos += take
    return pos


def _encode_chunk(ranks, per_class, counts, unary, u_pos, rem, r_pos, rows):
    # Codes a chunk's groups (class-major ranks, as kernels.class_ranks gives
    # them) at bit positions u_pos / r_pos; returns the new positions and the
    # number of rows written, or (bits wanted, bits wanted, -1) when a buffer
    # is too small, having written nothing.
    g = np.empty(max(1, ranks.size), np.int64)
    ks = np.zeros(N_CLASSES, np.int64)
    u_need = 0
    r_need = 0
    lo = 0
    for c in range(N_CLASSES):
        m = per_class[c]
        if m == 0:
            continue
        n = _group_gaps(ranks, lo, m, counts[c], 2 * m > counts[c], g)
        k = _best_k(g, n)
        ks[c] = k
        for j in range(n):
            u_need += (g[j] >> k) + 1
        r_need += n * k
        lo += m
    if u_pos + u_need > 8 * unary.size or r_pos + r_need > 8 * rem.size:
        return u_pos + u_need, r_pos + r_need, -1
    lo = 0
    n_rows = 0
    for c in range(N_CLASSES):
        m = per_class[c]
        if m == 0:
            continue
        invert = 2 * m > counts[c]
        n = _group_gaps(ranks, lo, m, counts[c], invert, g)
        k = ks[c]
        for j in range(n):
            q = g[j] >> k
            while q > 0:  # the quotient's ones (its zero is already there)
                take = min(q, 56)
                u_pos = _put(unary, u_pos, (1 << take) - 1, take)
                q -= take
            u_pos += 1
            r_pos = _put(rem, r_pos, g[j], k)
        lo += m
        rows[n_rows, 0] = c
        rows[n_rows, 1] = k
        rows[n_rows, 2] = 1 if invert else 0
        rows[n_rows, 3] = m
        rows[n_rows, 4] = counts[c] - m if invert else 0
        n_rows += 1
    return u_pos, r_pos, n_rows


def _get(buf, pos, nbits):
    # nbits at bit pos, MSB first (the caller has checked they are there).
    v = 0
    while nbits > 0:
        space = 8 - (pos & 7)
        take = min(space, nbits)
        v = (v << take) | ((buf[pos >> 3] >> (space - take)) & ((1 << take) - 1))
        pos += take
        nbits -= take
    return v


def _decode_chunk(unary, u_pos, rem, r_pos, groups, limit, want):
    # Reads a chunk's groups (rows of cls, k, invert, count, kept) from bit
    # positions u_pos / r_pos into `want`: each class's changed ranks, sorted,
    # class after class. An inverted group's class holds count + kept
    # elements; other ranks are bounded by the chunk (`limit`: the element
    # pass then checks each against its class). Returns the new positions
    # and 0, or an ERRORS code.
    u_end = 8 * unary.size
    r_end = 8 * rem.size
    out = 0
    for gi in range(groups.shape[0]):
        k = groups[gi, 1]
        invert = groups[gi, 2] != 0
        m = groups[gi, 3]
        kept = groups[gi, 4]
        bound = m + kept if invert else limit
        if m == 0 or m > bound or bound > limit or (kept and not invert):
            return u_pos, r_pos, -1
        coded = kept if invert else m
        q_max = bound >> k  # a larger quotient puts the rank past the bound
        prev = -1
        for j in range(coded):
            # The quotient's ones a byte at a time (a table of each byte's
            # leading ones), where reading them a bit at a time was two
            # fifths of a decode.
            q = 0
            while True:
                if u_pos >= u_end:
                    return u_pos, r_pos, -2
                sh = u_pos & 7
                ones = _LEADING_ONES[(unary[u_pos >> 3] << sh) & 0xFF]
                if ones < 8 - sh:  # the quotient's zero is in this byte
                    q += ones
                    u_pos += ones + 1
                    break
                q += 8 - sh
                u_pos += 8 - sh
                if q > q_max:
                    return u_pos, r_pos, -4
            if q > q_max:
                return u_pos, r_pos, -4
            if r_pos + k > r_end:
                return u_pos, r_pos, -3
            r = _get(rem, r_pos, k)
            r_pos += k
            rank = prev + ((q << k) | r) + 1
            # Room below the bound for the coded ranks still to come: an
            # inverted group writes the ranks between coded ones, and a first
            # rank near the bound would write past the group's `m` slots.
            if rank > bound - coded + j:
                return u_pos, r_pos, -4
            if invert:
                for x in range(prev + 1, rank):
                    want[out] = x
                    out += 1
            else:
                want[out] = rank
                out += 1
            prev = rank
        if invert:
            for x in range(prev + 1, bound):
                want[out] = x
                out += 1
    return u_pos, r_pos, 0


def _u32_plane(data, at, count, i):
    # Value i of `count` little-endian u32s stored as byte planes from `at`.
    v = 0
    for b in range(4):
        v |= np.int64(data[at + b * count + i]) << (8 * b)
    return v


def _group_table(data, rows, n, chunk, max_k, check, out):  # pragma: no cover - compiled
    # Reads positions.pack_groups' wire form (its row count already read and
    # its length checked against it) into out, one row a group; with
    # `check`, holds it to a tensor of n elements in chunks of `chunk`.
    # Returns 0 or an ERRORS code, checks in the order their messages rank.
    at = 4
    c = 0
    for i in range(rows):
        c = (c + _u32_plane(data, at, rows, i)) & 0xFFFFFFFF  # a u32 column, as on the wire
        out[i, 0] = c
    at += 4 * rows
    for col in range(1, 4):  # cls, k, invert: a byte each
        for i in range(rows):
            out[i, col] = data[at + i]
        at += rows
    n_inv = 0
    for i in range(rows):
        out[i, 4] = _u32_plane(data, at, rows, i)
        if out[i, 3] != 0:
            n_inv += 1
    at += 4 * rows
    if data.size != at + 4 * n_inv:
        return -12
    j = 0
    for i in range(rows):
        out[i, 5] = 0
        if out[i, 3] != 0:
            out[i, 5] = _u32_plane(data, at, n_inv, j)
            j += 1
    if not check:
        return 0
    n_chunks = (n + chunk - 1) // chunk
    for i in range(rows):
        if out[i, 0] >= n_chunks or out[i, 1] >= N_CLASSES or out[i, 2] > max_k:
            return -13
    for i in range(1, rows):
        if out[i, 0] * N_CLASSES + out[i, 1] <= out[i - 1, 0] * N_CLASSES + out[i - 1, 1]:
            return -14
    for i in range(rows):
        if out[i, 3] > 1:
            return -15
    # Before anything is sized by them: no group holds more elements than
    # its chunk (a class of an inverted group is count + kept of them).
    for i in range(rows):
        if out[i, 4] == 0 or out[i, 4] + out[i, 5] > min(chunk, n - out[i, 0] * chunk):
            return -1
    return 0


def _compile():
    if os.environ.get("COLONNADE_NO_NUMBA") == "1":
        return None
    try:
        import numba
    except ImportError:
        return None
    jit = numba.njit(cache=True, nogil=True)
    # Helpers first: the kernels call them by these module globals.
    g = globals()
    for name in ("_best_k", "_group_gaps", "_put", "_get", "_u32_plane"):
        g[name] = jit(g[name])
    return jit(_encode_chunk), jit(_decode_chunk), jit(_group_table)


_KERNELS = _compile()
COMPILED = _KERNELS is not None


class BitWriter:
    """A growing, zeroed bit buffer and its position (MSB-first)."""

    def __init__(self, capacity: int = 1 << 12) -> None:
        self.buf = np.zeros(capacity, np.uint8)
        self.pos = 0

    def reserve(self, bits: int) -> None:
        if bits > 8 * self.buf.size:
            grown = np.zeros(max(2 * self.buf.size, -(-bits // 8)), np.uint8)
            grown[: self.buf.size] = self.buf
            self.buf = grown

    def getvalue(self) -> bytes:
        return self.buf[: -(-self.pos // 8)].tobytes()


def encode_chunk(
    ranks: np.ndarray,
    per_class: np.ndarray,
    counts: np.ndarray,
    unary: BitWriter,
    rem: BitWriter,
) -> np.ndarray:
    """Code one chunk's groups onto the two streams; its rows (cls, k, invert,
    count, kept: an inverted group's unchanged elements, else 0)."""
    rows = np.zeros((N_CLASSES, 5), np.int64)
    while True:
        u, r, n = _KERNELS[0](
            ranks, per_class, counts, unary.buf, unary.pos, rem.buf, rem.pos, rows
        )
        if n >= 0:
            unary.pos, rem.pos = u, r
            return rows[:n]
        unary.reserve(u)
        rem.reserve(r)


def decode_chunk(
    unary: np.ndarray,
    u_pos: int,
    rem: np.ndarray,
    r_pos: int,
    groups: np.ndarray,
    limit: int,
) -> tuple[np.ndarray, int, int]:
    """(changed ranks, class after class; new u_pos, r_pos) of one chunk's
    groups (rows of cls, k, invert, count, kept) in a chunk of `limit`
    elements; ValueError if the streams are bad."""
    want = np.empty(int(groups[:, 3].sum()), np.int64)
    u, r, err = _KERNELS[1](unary, u_pos, rem, r_pos, groups, limit, want)
    if err:
        raise ValueError(ERRORS[err])
    return want, u, r


def group_table(raw: bytes, n: int = 0, chunk: int = 1, check: bool = False) -> np.ndarray:
    """A group table's wire form (positions.pack_groups) read into rows of
    int64, one column per field of positions.GROUP_DTYPE in its order (chunk,
    cls, k, invert, count, kept); with `check`,
    held to a tensor of n elements in chunks of `chunk`. ValueError where
    it is not one. One compiled pass: the numpy version's two dozen calls
    were a twentieth of an apply."""
    data = np.frombuffer(raw, np.uint8)
    if data.size < 4:
        raise ValueError(ERRORS[-10])
    rows = int(data[:4].view("<u4")[0])
    if check and rows > -(-n // chunk) * N_CLASSES:
        # More groups than (chunk, class) pairs: refused before any work or
        # memory (the checks below would refuse it too, after both).
        raise ValueError(ERRORS[-13])
    if data.size < 4 + 11 * rows:
        raise ValueError(ERRORS[-11])
    out = np.empty((rows, 6), np.int64)
    kernel = _KERNELS[2] if _KERNELS is not None else _group_table
    err = kernel(data, rows, n, chunk, MAX_RICE_K, check, out)
    if err:
        raise ValueError(ERRORS[err])
    return out
