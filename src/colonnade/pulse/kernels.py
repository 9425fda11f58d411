"""The per-element loops of position coding, in numba or in numpy.

Position coding needs, for every changed element of a chunk, its rank among
the elements of the same context class (encoder), and the inverse: the index
of the element with a given class and rank (decoder). Both are one pass over
the chunk. numpy can only express them through a stable argsort and a table
look-up per element (~20 ns an element); numba runs the pass itself and
computes each class on the fly (~2 ns an element), which keeps publishing a
multi-billion-parameter patch in seconds rather than minutes. numba is
optional: without it (or with COLONNADE_NO_NUMBA=1) the numpy versions run
and produce the same bytes.

Class sources (see context.py):
  MODE_LUT    class = lut[bits[i] >> shift]   (float exponents; all-zero table: one class)
  MODE_ARRAY  class = arr[i]                  (int8 codes by row scale, precomputed)
"""

from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

N_CLASSES = 16
MODE_LUT, MODE_ARRAY = 0, 1


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
    import numba

    # Each kernel runs its element loop once per class mode, written out in
    # full: numba's inlined helpers taking arrays paid reference counting on
    # every call, which made the loops ten times slower.
    @numba.njit(cache=True, nogil=True)
    def class_ranks(new, bits, mode, lut, shift, arr):  # pragma: no cover - compiled
        # Changes and classes are computed twice rather than stored: chunk-sized
        # mask and class arrays are memory the encoder holds for nothing.
        n = bits.size
        per_class = np.zeros(N_CLASSES, np.int64)
        for i in range(n):
            if new[i] != bits[i]:
                per_class[lut[bits[i] >> shift] if mode == MODE_LUT else arr[i]] += 1
        fill = np.zeros(N_CLASSES, np.int64)
        for c in range(1, N_CLASSES):
            fill[c] = fill[c - 1] + per_class[c - 1]
        m = fill[N_CLASSES - 1] + per_class[N_CLASSES - 1]
        # int32: chunk-local (a chunk is far below 2^31 elements), half the memory.
        order = np.empty(m, np.int32)
        ranks = np.empty(m, np.int32)
        counts = np.zeros(N_CLASSES, np.int64)
        for i in range(n):
            c = lut[bits[i] >> shift] if mode == MODE_LUT else arr[i]
            if new[i] != bits[i]:
                order[fill[c]] = i
                ranks[fill[c]] = counts[c]
                fill[c] += 1
            counts[c] += 1
        return order, ranks, counts, per_class

    @numba.njit(cache=True, nogil=True)
    def class_counts(n, bits, mode, lut, shift, arr):  # pragma: no cover - compiled
        counts = np.zeros(N_CLASSES, np.int64)
        if mode == MODE_LUT:
            for i in range(n):
                counts[lut[bits[i] >> shift]] += 1
        else:
            for i in range(n):
                counts[arr[i]] += 1
        return counts

    @numba.njit(cache=True, nogil=True)
    def scatter(n, bits, mode, lut, shift, arr, want_start, want):  # pragma: no cover
        # want: every class's sorted ranks back to back, class c's from
        # want_start[c] to want_start[c+1]; returns their element indices.
        ptr = want_start[:N_CLASSES].copy()
        seen = np.zeros(N_CLASSES, np.int64)
        out = np.empty(want.size, np.int32)
        for i in range(n):
            c = lut[bits[i] >> shift] if mode == MODE_LUT else arr[i]
            p = ptr[c]
            if p < want_start[c + 1] and want[p] == seen[c]:
                out[p] = i
                ptr[c] = p + 1
            seen[c] += 1
        ok = True
        for c in range(N_CLASSES):
            ok = ok and ptr[c] == want_start[c + 1]
        return out, ok

    @numba.njit(cache=True, nogil=True)
    def max_field(bits, shift, mask):  # pragma: no cover - compiled
        top = 0
        for i in range(bits.size):
            e = (bits[i] >> shift) & mask
            if e > top:
                top = e
        return top

    return class_ranks, class_counts, scatter, max_field


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
    bits: np.ndarray, new: np.ndarray, src: ClassSource, classes_fn, backend: str | None = None
):
    """(order, ranks, class sizes, changed per class) of one chunk's changes.

    bits: the chunk's base bits; new: its new bits (an element changed where
    they differ); classes_fn(): the chunk's classes as an array, asked for
    only by the numpy path.
    """
    if _use_numba(backend):
        return _NUMBA[0](new, *_args(bits, src))
    return _numpy_class_ranks(bits != new, classes_fn())


def class_counts(
    n: int, bits: np.ndarray, src: ClassSource, classes_fn, backend: str | None = None
) -> np.ndarray:
    if _use_numba(backend):
        return _NUMBA[1](n, *_args(bits, src))
    return np.bincount(classes_fn(), minlength=N_CLASSES)


def scatter_ranks(
    n: int,
    bits: np.ndarray,
    src: ClassSource,
    classes_fn,
    group_cls: list[int],
    ranks: list[np.ndarray],
    backend: str | None = None,
) -> np.ndarray:
    """Indices, in class-major order, of the elements with the given (class, ranks)."""
    if not _use_numba(backend):
        return _numpy_scatter(classes_fn(), np.array(group_cls, np.int64), ranks)
    per = np.zeros(N_CLASSES, np.int64)
    for c, r in zip(group_cls, ranks, strict=True):
        per[c] = r.size
    start = np.concatenate(([0], np.cumsum(per)))
    want = np.concatenate(ranks).astype(np.int64) if ranks else np.zeros(0, np.int64)
    out, ok = _NUMBA[2](n, *_args(bits, src), start, want)
    if not ok:
        raise ValueError("a rank lies beyond its class")
    return out


def max_field(bits: np.ndarray, shift: int, mask: int) -> int:
    """Largest (bits >> shift) & mask over the array."""
    if _NUMBA is not None:
        return int(_NUMBA[3](bits, bits.dtype.type(shift), bits.dtype.type(mask)))
    ut = bits.dtype.type
    step = 1 << 22
    return max(
        (
            int(((bits[s : s + step] >> ut(shift)) & ut(mask)).max())
            for s in range(0, bits.size, step)
        ),
        default=0,
    )
