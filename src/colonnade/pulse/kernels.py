"""The per-element loops of position coding, in numba or in numpy.

Position coding needs, for every changed element of a chunk, its rank among
the elements of the same context class (encoder), and the inverse: the index
of the element with a given class and rank (decoder). Both are one pass over
the chunk. numpy can only express them through a stable argsort and a table
look-up per element; numba runs the pass itself and computes each class on
the fly, an order of magnitude faster (docs/benchmarks.md), which keeps
publishing a multi-billion-parameter patch in seconds rather than minutes.
numba is optional: without it (or with COLONNADE_NO_NUMBA=1) the numpy
versions run and produce the same bytes.

Class sources (see context.py):
  MODE_LUT    class = lut[bits[i] >> shift]   (float exponents; all-zero table: one class)
  MODE_ARRAY  class = arr[i]                  (int8 codes by row scale, precomputed)
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

from . import bitcodes

N_CLASSES = 16
# A class's distance to its next wanted rank when it has none left (scatter).
FAR = 1 << 62
MODE_LUT, MODE_ARRAY = 0, 1
# Order-preserving keys of the "delta" residual (bitcodes.ordered_key).
KEY_UNSIGNED, KEY_FLOAT, KEY_SIGNED = 0, 1, 2
# How a residual rebuilds the new bits (residuals.rebuild): XOR, or key delta.
RES_XOR, RES_DELTA = 0, 1


class ClassSource(NamedTuple):
    mode: int  # MODE_LUT: class = lut[bits[i] >> shift]; MODE_ARRAY: class = arr[i]
    lut: np.ndarray
    shift: int
    arr: np.ndarray


def _numpy_class_ranks(changed: np.ndarray, cls: np.ndarray):
    perm = np.argsort(cls, kind="stable")
    counts = np.bincount(cls, minlength=N_CLASSES)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    sorted_pos = np.flatnonzero(changed[perm])
    cls_of = np.searchsorted(offsets, sorted_pos, side="right") - 1
    per_class = np.bincount(cls_of, minlength=N_CLASSES)
    return perm[sorted_pos], sorted_pos - offsets[cls_of], counts, per_class


def _numpy_scatter(cls: np.ndarray, group_cls: np.ndarray, ranks: list[np.ndarray]):
    perm = np.argsort(cls, kind="stable")
    offsets = np.concatenate(([0], np.cumsum(np.bincount(cls, minlength=N_CLASSES))))
    parts = [offsets[c] + r for c, r in zip(group_cls, ranks, strict=True)]
    return perm[np.concatenate(parts)] if parts else np.zeros(0, np.int64)


def _build_numba():
    # The helpers the kernels call are module globals, not closure cells:
    # numba keys a cached closure by a pickle of its cells, and a pickled
    # dispatcher differs in every process, so each process compiled the
    # kernels again (seconds on a worker's first patch) and added a file to
    # the cache.
    global _ahead, _find
    import numba

    # Each kernel runs its element loop once per class mode, written out in
    # full: numba's inlined helpers taking arrays paid reference counting on
    # every call, which made the loops many times slower.
    # One count per class, read and bumped at every element. (Four counts a
    # class taken in turn, so that consecutive elements of one class do not
    # wait on each other's stores, measured slower on the Intel Xeon of
    # docs/benchmarks.md: the loads that sum them cost more than the wait.)
    @numba.njit(cache=True, nogil=True)
    def class_ranks(new, bits, mode, lut, shift, arr, key, width):  # pragma: no cover
        # One pass over old and new: each change is noted with its class,
        # rank, old and new bits as it goes by (so the sort after it reads no
        # element again: the chunk is out of the core's cache by then), then
        # a counting sort of the (few) changes puts them class-major. The
        # note arrays are sized for every element but touched only as far as
        # changes fill them (untouched pages cost no memory). int32:
        # chunk-local, a chunk is far below 2^31 elements.
        n = bits.size
        h = np.zeros(N_CLASSES, np.int64)
        idx = np.empty(n, np.int32)
        rk = np.empty(n, np.int32)
        cl = np.empty(n, np.uint8)
        was = np.empty_like(bits[: n if width else 0])
        now = np.empty_like(bits[: n if width else 0])
        m = 0
        if mode == MODE_LUT:
            for i in range(n):
                b = bits[i]
                c = lut[b >> shift]
                r = h[c]
                if new[i] != b:
                    idx[m] = i
                    rk[m] = r
                    cl[m] = c
                    if width:
                        was[m] = b
                        now[m] = new[i]
                    m += 1
                h[c] = r + 1
        else:
            for i in range(n):
                b = bits[i]
                c = arr[i]
                r = h[c]
                if new[i] != b:
                    idx[m] = i
                    rk[m] = r
                    cl[m] = c
                    if width:
                        was[m] = b
                        now[m] = new[i]
                    m += 1
                h[c] = r + 1
        counts = h
        per_class = np.zeros(N_CLASSES, np.int64)
        for j in range(m):
            per_class[cl[j]] += 1
        fill = np.zeros(N_CLASSES, np.int64)
        for c in range(1, N_CLASSES):
            fill[c] = fill[c - 1] + per_class[c - 1]
        # With the sort, each change's two residual transforms (residuals.py),
        # computed in int64 on keys of `width` ≤ 32 bits (width 0: not here).
        order = np.empty(m, np.int32)
        ranks = np.empty(m, np.int32)
        xor = np.empty_like(bits[: m if width else 0])
        delta = np.empty_like(bits[: m if width else 0])
        mask = (1 << width) - 1
        top = 1 << (width - 1) if width else 0
        for j in range(m):
            c = cl[j]
            p = fill[c]
            order[p] = idx[j]
            ranks[p] = rk[j]
            fill[c] += 1
            if width:
                o = np.int64(was[j])
                nw = np.int64(now[j])
                xor[p] = o ^ nw
                if key == KEY_FLOAT:
                    o = (~o) & mask if o & top else o | top
                    nw = (~nw) & mask if nw & top else nw | top
                elif key == KEY_SIGNED:
                    o ^= top
                    nw ^= top
                d = (nw - o) & mask
                delta[p] = (~(d << 1)) & mask if d & top else (d << 1) & mask
        return order, ranks, counts, per_class, xor, delta

    # The inverse pass keeps, per class, how many of its elements are still
    # to go by before its next wanted rank (`ahead`; FAR: none wanted): an
    # element is wanted where its class's count is 0, and otherwise only
    # that count goes down. No running class sizes, and one load and one
    # store an element. A class's wanted ranks must rise strictly (as the
    # decoded gaps make them); if not, a count goes below 0, never meets 0
    # again, and the pass reports the ranks as not all found.
    @numba.njit(cache=True, nogil=True)
    def _ahead(want_start, want):  # pragma: no cover - compiled
        ahead = np.full(N_CLASSES, FAR, np.int64)
        for c in range(N_CLASSES):
            if want_start[c] < want_start[c + 1]:
                ahead[c] = want[want_start[c]]
        return ahead

    # The element loop only finds the wanted elements (the rebuild of the few
    # found runs after it): with the rebuild inside, the loop's state spilled
    # out of the registers and each element paid five more loads from the
    # stack (a fifth of an apply, docs/benchmarks.md). Written out per class
    # mode, and for the copying pass with the copy inside, like class_ranks.
    @numba.njit(cache=True, nogil=True)
    def _find(n, bits, out, copy, mode, lut, shift, arr, want_start, want):  # pragma: no cover
        # want: every class's sorted ranks back to back, class c's from
        # want_start[c] to want_start[c+1]; returns their element indices
        # (class-major) and whether every rank was found. With `copy`, out
        # gets every element of bits as it goes by.
        ptr = want_start[:N_CLASSES].copy()
        ahead = _ahead(want_start, want)
        loc = np.empty(want.size, np.int32)
        if mode == MODE_LUT and copy:
            for i in range(n):
                b = bits[i]
                out[i] = b
                c = lut[b >> shift]
                a = ahead[c]
                if a != 0:
                    ahead[c] = a - 1
                    continue
                p = ptr[c]
                loc[p] = i
                p += 1
                ptr[c] = p
                ahead[c] = want[p] - want[p - 1] - 1 if p < want_start[c + 1] else FAR
        elif mode == MODE_LUT:
            for i in range(n):
                c = lut[bits[i] >> shift]
                a = ahead[c]
                if a != 0:
                    ahead[c] = a - 1
                    continue
                p = ptr[c]
                loc[p] = i
                p += 1
                ptr[c] = p
                ahead[c] = want[p] - want[p - 1] - 1 if p < want_start[c + 1] else FAR
        else:
            if copy:
                out[:n] = bits[:n]
            for i in range(n):
                c = arr[i]
                a = ahead[c]
                if a != 0:
                    ahead[c] = a - 1
                    continue
                p = ptr[c]
                loc[p] = i
                p += 1
                ptr[c] = p
                ahead[c] = want[p] - want[p - 1] - 1 if p < want_start[c + 1] else FAR
        ok = True
        for c in range(N_CLASSES):
            ok = ok and ptr[c] == want_start[c + 1]
        return loc, ok

    @numba.njit(cache=True, nogil=True)
    def scatter(n, bits, mode, lut, shift, arr, want_start, want):  # pragma: no cover
        # Nothing is copied: an empty `out`, so read-only bits type too.
        return _find(
            n, bits, np.empty(0, bits.dtype), False, mode, lut, shift, arr, want_start, want
        )

    @numba.njit(cache=True, nogil=True)
    def scatter_rebuild(
        n, bits, out, copy, mode, lut, shift, arr, want_start, want, values, res, key, width, before
    ):  # pragma: no cover - compiled
        # _find, then each element found gets its new bits in out (the
        # chunk's destination: its own memory in place, else a copy that
        # _find filled) from its residual (residuals.rebuild, in int64 on
        # keys of `width` <= 32 bits), its old bits kept in `before`. Nothing
        # is written unless every rank was found, so a chunk that fails in
        # place leaves its elements as they were.
        loc, ok = _find(n, bits, out, copy, mode, lut, shift, arr, want_start, want)
        if not ok:
            return loc, ok
        mask = (1 << width) - 1
        top = 1 << (width - 1)
        for p in range(want.size):
            i = loc[p]
            b = bits[i]
            before[p] = b
            o = np.int64(b)
            v = np.int64(values[p])
            if res == RES_XOR:
                nw = o ^ v
            else:
                if key == KEY_FLOAT:
                    o = (~o) & mask if o & top else o | top
                elif key == KEY_SIGNED:
                    o ^= top
                half = v >> 1
                d = (~half) & mask if v & 1 else half
                nw = (o + d) & mask
                if key == KEY_FLOAT:
                    nw = nw & (mask ^ top) if nw & top else (~nw) & mask
                elif key == KEY_SIGNED:
                    nw ^= top
            out[i] = nw
        return loc, ok

    return class_ranks, scatter, scatter_rebuild


_NUMBA = None
if os.environ.get("COLONNADE_NO_NUMBA") != "1":
    try:
        _NUMBA = _build_numba()
    except ImportError:
        _NUMBA = None

BACKEND = "numba" if _NUMBA else "numpy"


def _use_numba(backend: str | None) -> bool:
    return _NUMBA is not None and (backend or BACKEND) == "numba"


def _args(bits: np.ndarray, src: ClassSource) -> tuple:
    return (bits, src.mode, src.lut, src.shift, src.arr)


def class_ranks(
    bits: np.ndarray,
    new: np.ndarray,
    src: ClassSource,
    classes_fn,
    backend: str | None = None,
    key: int | None = None,
):
    """(order, ranks, class sizes, changed per class) of one chunk's changes,
    and with `key` (KEY_*) their residuals: (…, xor, delta), in order.

    bits: the chunk's base bits; new: its new bits (an element changed where
    they differ); classes_fn(): the chunk's classes as an array, asked for
    only by the numpy path. The compiled pass reads each element once and
    gathers the residuals of the changes as it sorts them; elements wider
    than 32 bits, and the numpy path, take theirs from residual_transforms.
    """
    width = bits.dtype.itemsize * 8 if key is not None and bits.dtype.itemsize <= 4 else 0
    if _use_numba(backend):
        found = _NUMBA[0](new, *_args(bits, src), key or 0, width)
    else:
        found = (*_numpy_class_ranks(bits != new, classes_fn()), None, None)
    if key is None:
        return found[:4]
    if not width or not _use_numba(backend):
        order = found[0]
        found = (*found[:4], *residual_transforms(bits[order], new[order], key))
    return found


def residual_transforms(old: np.ndarray, new: np.ndarray, key: int):
    """(new XOR old, zigzag(key(new) − key(old))) of changed elements, in numpy."""
    is_float, is_signed = key == KEY_FLOAT, key == KEY_SIGNED
    k_new = bitcodes.ordered_key(new, is_float, is_signed)
    k_old = bitcodes.ordered_key(old, is_float, is_signed)
    return old ^ new, bitcodes.zigzag(k_new - k_old)


class Wanted(NamedTuple):
    """The (class, rank) pairs a chunk's inverse pass looks for."""

    start: np.ndarray  # int64[N_CLASSES + 1]: class c's ranks are want[start[c]:start[c + 1]]
    want: np.ndarray  # int64: each class's ranks, rising, class after class

    @classmethod
    def of(cls, group_cls: list[int], ranks: list[np.ndarray]) -> Wanted:
        """From each class's ranks."""
        counts = np.array([r.size for r in ranks], np.int64)
        want = np.concatenate(ranks).astype(np.int64) if ranks else np.zeros(0, np.int64)
        return cls.flat(np.array(group_cls, np.int64), counts, want)

    @classmethod
    def flat(cls, group_cls: np.ndarray, counts: np.ndarray, want: np.ndarray) -> Wanted:
        """From the ranks already back to back (`counts` of them for each of
        `group_cls`, in rising class order), as the Rice decoder gives them."""
        per = np.zeros(N_CLASSES, np.int64)
        per[group_cls] = counts
        return cls(np.concatenate(([0], np.cumsum(per))), want)

    def groups(self) -> tuple[np.ndarray, list[np.ndarray]]:
        """(classes with ranks, their ranks)."""
        cs = np.flatnonzero(np.diff(self.start))
        return cs, [self.want[self.start[c] : self.start[c + 1]] for c in cs]


def scatter_ranks(
    n: int,
    bits: np.ndarray,
    src: ClassSource,
    classes_fn,
    wanted: Wanted,
    backend: str | None = None,
) -> np.ndarray:
    """Indices, in class-major order, of the elements with the wanted (class, ranks)."""
    if not _use_numba(backend):
        return _numpy_scatter(classes_fn(), *wanted.groups())
    out, ok = _NUMBA[1](n, *_args(bits, src), wanted.start, wanted.want)
    if not ok:
        raise ValueError("a rank lies beyond its class")
    return out


def scatter_rebuild(
    n: int,
    bits: np.ndarray,
    out: np.ndarray,
    src: ClassSource,
    classes_fn,
    wanted: Wanted,
    values: np.ndarray,
    res: int,
    key: int,
    backend: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Rebuild a chunk's changes: (their indices, their old bits), class-major.

    bits: the chunk's base bits; out: where its new bits go (bits itself, in
    place, or a fresh array that gets the unchanged elements copied too);
    values: the residuals of the changes in class-major order (res: RES_*,
    key: KEY_*). Where compiled (elements of ≤ 32 bits), one pass over the
    chunk finds them and a second over those found rebuilds them; otherwise
    scatter_ranks, then numpy.
    """
    width = bits.dtype.itemsize * 8
    if _use_numba(backend) and width <= 32:
        start, want = wanted
        if want.size != values.size:
            raise ValueError("residual count does not match the positions")
        before = np.empty(want.size, bits.dtype)
        loc, ok = _NUMBA[2](
            n,
            bits,
            out,
            out.ctypes.data != bits.ctypes.data,
            src.mode,
            src.lut,
            src.shift,
            src.arr,
            start,
            want,
            values,
            res,
            key,
            width,
            before,
        )
        if not ok:
            raise ValueError("a rank lies beyond its class")
        return loc, before
    loc = scatter_ranks(n, bits, src, classes_fn, wanted, backend)
    if loc.size != values.size:
        raise ValueError("residual count does not match the positions")
    before = bits[loc]
    if out.ctypes.data != bits.ctypes.data:
        np.copyto(out, bits)
    out[loc] = rebuild_values(before, values, res, key)
    return loc, before


def rebuild_values(old: np.ndarray, values: np.ndarray, res: int, key: int) -> np.ndarray:
    """New bits from old bits and residuals (the inverse of residual_transforms)."""
    if res == RES_XOR:
        return old ^ values
    is_float, is_signed = key == KEY_FLOAT, key == KEY_SIGNED
    keys = bitcodes.ordered_key(old, is_float, is_signed) + bitcodes.unzigzag(values)
    return bitcodes.from_ordered_key(keys, is_float, is_signed)


def top_magnitude(bits: np.ndarray) -> int:
    """The largest magnitude (the bits below the sign) of sign-magnitude
    numbers stored as unsigned bits, 0 for none: for a float, its largest
    exponent is this >> the mantissa width.

    Two of numpy's vectorized reductions over the buffer as it is, no copy:
    as unsigned, a value with the sign bit set wins, so the maximum is the
    largest negative magnitude if there is a negative; as signed, the
    maximum is the largest non-negative value if there is one.
    """
    if bits.size == 0:
        return 0
    sign = 1 << (bits.dtype.itemsize * 8 - 1)
    top = int(bits.max())
    if top < sign:  # no negatives: the unsigned maximum is the answer
        return top
    signed = int(bits.view(f"i{bits.dtype.itemsize}").max())
    return max(top - sign, signed)
