"""The two per-element loops of position coding, in numba or in numpy.

Position coding needs, for every changed element of a chunk, its rank among
the elements of the same context class (encoder), and the inverse: the index
of the element with a given class and rank (decoder). Both are a single pass
over the chunk. numpy can only express them through a stable argsort (one
sort per chunk, ~15 ns an element); numba runs the pass itself (~2 ns an
element), which is what keeps publishing a multi-billion-parameter patch in
seconds rather than minutes. numba is optional: without it (or with
COLONNADE_NO_NUMBA=1) the numpy versions run and produce the same bytes.

Both backends return, for a chunk: `order`, the changed indices in class-major
order (class 0 first, index order inside a class), and `ranks`, their ranks
within their class, in the same order; `counts`, the size of every class.
"""

from __future__ import annotations

import os

import numpy as np

N_CLASSES = 16


def _numpy_class_ranks(changed: np.ndarray, cls: np.ndarray):
    perm = np.argsort(cls, kind="stable")
    counts = np.bincount(cls, minlength=N_CLASSES)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    sorted_pos = np.flatnonzero(changed[perm])
    cls_of = np.searchsorted(offsets, sorted_pos, side="right") - 1
    return perm[sorted_pos], sorted_pos - offsets[cls_of], counts


def _numpy_scatter_ranks(cls: np.ndarray, group_cls: np.ndarray, ranks: list[np.ndarray]):
    perm = np.argsort(cls, kind="stable")
    counts = np.bincount(cls, minlength=N_CLASSES)
    offsets = np.concatenate(([0], np.cumsum(counts)))
    parts = [offsets[c] + r for c, r in zip(group_cls, ranks, strict=True)]
    flat = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return perm[flat]


def _class_counts(cls: np.ndarray) -> np.ndarray:
    return np.bincount(cls, minlength=N_CLASSES)


def _build_numba():
    import numba

    @numba.njit(cache=True, nogil=True)
    def class_ranks(changed, cls):  # pragma: no cover - compiled
        n = cls.size
        counts = np.zeros(N_CLASSES, np.int64)
        per_class = np.zeros(N_CLASSES, np.int64)
        m = 0
        for i in range(n):
            if changed[i]:
                per_class[cls[i]] += 1
                m += 1
        start = np.zeros(N_CLASSES + 1, np.int64)
        for c in range(N_CLASSES):
            start[c + 1] = start[c] + per_class[c]
        fill = start[:N_CLASSES].copy()
        order = np.empty(m, np.int64)
        ranks = np.empty(m, np.int64)
        for i in range(n):
            c = cls[i]
            if changed[i]:
                order[fill[c]] = i
                ranks[fill[c]] = counts[c]
                fill[c] += 1
            counts[c] += 1
        return order, ranks, counts

    @numba.njit(cache=True, nogil=True)
    def scatter(cls, want_start, ranks):  # pragma: no cover - compiled
        # ranks: every class's sorted ranks back to back, class c's from
        # want_start[c] to want_start[c+1]; returns their element indices.
        ptr = want_start[:N_CLASSES].copy()
        seen = np.zeros(N_CLASSES, np.int64)
        out = np.empty(ranks.size, np.int64)
        for i in range(cls.size):
            c = cls[i]
            p = ptr[c]
            if p < want_start[c + 1] and ranks[p] == seen[c]:
                out[p] = i
                ptr[c] = p + 1
            seen[c] += 1
        ok = True
        for c in range(N_CLASSES):
            ok = ok and ptr[c] == want_start[c + 1]
        return out, ok

    return class_ranks, scatter


_NUMBA = None
if os.environ.get("COLONNADE_NO_NUMBA") != "1":
    try:
        _NUMBA = _build_numba()
    except ImportError:
        _NUMBA = None

BACKEND = "numba" if _NUMBA else "numpy"


def class_ranks(changed: np.ndarray, cls: np.ndarray, backend: str | None = None):
    """(order, ranks, counts) of the changed elements of one chunk."""
    if (backend or BACKEND) == "numba" and _NUMBA:
        return _NUMBA[0](changed, cls)
    return _numpy_class_ranks(changed, cls)


def scatter_ranks(
    cls: np.ndarray, group_cls: np.ndarray, ranks: list[np.ndarray], backend: str | None = None
) -> np.ndarray:
    """Indices, in class-major order, of the elements of the given (class, ranks)."""
    if (backend or BACKEND) == "numba" and _NUMBA:
        per = np.zeros(N_CLASSES, np.int64)
        for c, r in zip(group_cls, ranks, strict=True):
            per[c] = r.size
        start = np.concatenate(([0], np.cumsum(per)))
        flat = np.concatenate(ranks) if ranks else np.zeros(0, np.int64)
        out, ok = _NUMBA[1](cls, start, flat.astype(np.int64))
        if not ok:
            raise ValueError("a rank lies beyond its class")
        return out
    return _numpy_scatter_ranks(cls, group_cls, ranks)


class_counts = _class_counts
