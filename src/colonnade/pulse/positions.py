"""Coding the positions of changed elements.

Two codes, the cheaper chosen per tensor:

- "rice": per chunk of the flattened tensor, elements are ordered by context
  class (stable), and within each class the ranks of changed elements are
  gap-coded with a Rice code whose parameter fits that class's density. Where
  more than half of a class changed, the unchanged ranks are coded instead.
  Gaps of a geometric source are what Rice codes are near-optimal for, and the
  split into quotient and remainder streams decodes without a sequential loop.
- "mask": a bitmask over the whole tensor, zstd-compressed; for dense changes.

Both return the changed indices in the order the residuals are stored: class
major within each chunk for "rice", ascending for "mask".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import zstandard

from colonnade import untrusted

from . import bitcodes, kernels
from .context import N_CLASSES, ClassMap

GROUP_DTYPE = np.dtype(
    [
        ("chunk", "<u4"),
        ("cls", "u1"),
        ("k", "u1"),
        ("invert", "u1"),
        ("pad", "u1"),
        ("count", "<u4"),
    ]
)


@dataclass
class GroupedGaps:
    groups: np.ndarray  # GROUP_DTYPE rows, one per (chunk, class) with any change
    gaps: list[np.ndarray]  # per row, the gaps of its coded ranks
    order: np.ndarray  # changed indices, in residual order


def _chunk_groups(order_cls: np.ndarray, ranks: np.ndarray, counts: np.ndarray):
    """Per class with changes: (class, class size, its changed ranks, sorted)."""
    cuts = np.searchsorted(order_cls, np.arange(N_CLASSES + 1))
    for c in range(N_CLASSES):
        lo, hi = cuts[c], cuts[c + 1]
        if hi > lo:
            yield c, int(counts[c]), ranks[lo:hi]


def _complement(ranks: np.ndarray, size: int) -> np.ndarray:
    keep = np.ones(size, dtype=bool)
    keep[ranks] = False
    return np.flatnonzero(keep)


def group_gaps(changed_mask: np.ndarray, cmap: ClassMap, chunk: int) -> GroupedGaps:
    """Rank gaps per (chunk, class), the ranks inverted where more than half changed."""
    rows, gaps, order = [], [], []
    for ci, start in enumerate(range(0, changed_mask.size, chunk)):
        stop = min(changed_mask.size, start + chunk)
        part = changed_mask[start:stop]
        if not part.any():
            continue
        chunk_order, ranks_all, counts, per_class = kernels.class_ranks(
            part,
            cmap.bits[start:stop],
            cmap.source(start, stop),
            lambda start=start, stop=stop: cmap.classes(start, stop),
        )
        order.append(chunk_order + start)
        order_cls = np.repeat(np.arange(N_CLASSES), per_class)
        for c, size, ranks in _chunk_groups(order_cls, ranks_all, counts):
            invert = 2 * ranks.size > size
            gaps.append(bitcodes.gaps_from_sorted(_complement(ranks, size) if invert else ranks))
            rows.append((ci, c, 0, int(invert), 0, ranks.size))
    return GroupedGaps(
        np.array(rows, dtype=GROUP_DTYPE),
        gaps,
        np.concatenate(order) if order else np.zeros(0, np.int64),
    )


def residual_classes(groups: np.ndarray) -> np.ndarray:
    """Context class of every residual, in residual order (class-major per chunk)."""
    return np.repeat(groups["cls"], groups["count"].astype(np.int64))


def _cat(xs: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(xs) if xs else np.zeros(0, dtype)


def rice_blocks(gg: GroupedGaps, level: int) -> list[bytes]:
    """[groups, unary quotients, remainders], a Rice parameter fitted per group."""
    rows = gg.groups.copy()
    unary, rem = [], []
    for i, gaps in enumerate(gg.gaps):
        k = bitcodes.best_rice_k(gaps)
        u, r = bitcodes.rice_encode(gaps, k)
        rows["k"][i] = k
        unary.append(u)
        rem.append(r)
    cctx = zstandard.ZstdCompressor(level=level)
    return [
        cctx.compress(rows.tobytes()),
        np.packbits(_cat(unary, np.uint8)).tobytes(),
        np.packbits(_cat(rem, np.uint8)).tobytes(),
    ]


def _unpack_groups(block: bytes, n: int, chunk: int) -> np.ndarray:
    raw = _decompress(block, None)
    if len(raw) % GROUP_DTYPE.itemsize:
        raise ValueError("group table has a partial row")
    g = np.frombuffer(raw, dtype=GROUP_DTYPE)
    n_chunks = -(-n // chunk)
    if g.size and (
        g["chunk"].max() >= n_chunks
        or g["cls"].max() >= N_CLASSES
        or g["k"].max() > bitcodes.MAX_RICE_K
    ):
        raise ValueError("group table out of range")
    key = g["chunk"].astype(np.int64) * N_CLASSES + g["cls"]
    if np.any(np.diff(key) <= 0):
        raise ValueError("group table not in order")
    return g


class _RiceReader:
    def __init__(self, blocks: list[memoryview]) -> None:
        self.blocks = blocks
        self.unary = bitcodes.UnaryReader(np.unpackbits(np.frombuffer(blocks[0], np.uint8)))
        self.rem = np.unpackbits(np.frombuffer(blocks[1], dtype=np.uint8))
        self.r_off = 0

    def read(self, count: int, k: int) -> np.ndarray:
        q = self.unary.read(count)
        r = bitcodes.fixed_decode(self.rem[self.r_off :], count, k)
        self.r_off += count * k
        return (q << np.uint64(k)) | r

    def check_used(self) -> None:
        if -(-self.unary.bits_used // 8) != len(self.blocks[0]) or -(-self.r_off // 8) != len(
            self.blocks[1]
        ):
            raise ValueError("position streams have unused bytes")


def rice_decode(
    blocks: list[memoryview], n: int, cmap: ClassMap, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Changed indices in residual order and their classes; ValueError on any inconsistency."""
    groups = _unpack_groups(bytes(blocks[0]), n, chunk)
    reader = _RiceReader(blocks[1:3])
    out = []
    for ci in np.unique(groups["chunk"]):
        start = int(ci) * chunk
        stop = min(n, start + chunk)
        # The numpy path computes the chunk's classes once, on first request.
        cache: list[np.ndarray] = []

        def classes_fn(start=start, stop=stop, cache=cache):
            if not cache:
                cache.append(cmap.classes(start, stop))
            return cache[0]

        bits, src = cmap.bits[start:stop], cmap.source(start, stop)
        counts = kernels.class_counts(stop - start, bits, src, classes_fn)
        classes, parts = [], []
        for g in groups[groups["chunk"] == ci]:
            c, size, m = int(g["cls"]), int(counts[g["cls"]]), int(g["count"])
            if m == 0 or m > size:
                raise ValueError("group count out of range")
            coded_n = size - m if g["invert"] else m
            ranks = bitcodes.sorted_from_gaps(reader.read(coded_n, int(g["k"])))
            if ranks.size and ranks[-1] >= size:
                raise ValueError("rank beyond its class")
            classes.append(c)
            parts.append(_complement(ranks, size) if g["invert"] else ranks)
        out.append(
            kernels.scatter_ranks(stop - start, bits, src, classes_fn, classes, parts) + start
        )
    reader.check_used()
    idx = np.concatenate(out) if out else np.zeros(0, np.int64)
    return idx, residual_classes(groups)


def mask_encode(changed_mask: np.ndarray, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(np.packbits(changed_mask).tobytes())


def mask_decode(block: memoryview, n: int) -> np.ndarray:
    raw = _decompress(bytes(block), -(-n // 8))
    if len(raw) != -(-n // 8):
        raise ValueError("bitmask has the wrong length")
    bits = np.unpackbits(np.frombuffer(raw, dtype=np.uint8), count=n)
    return np.flatnonzero(bits)


def _decompress(block: bytes, expected: int | None) -> bytes:
    # A full tensor's limit is its declared shape (up to 2^48 elements).
    return untrusted.decompress(block, expected if expected is not None else 64 << 20)


decompress = _decompress
