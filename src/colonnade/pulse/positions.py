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

from . import bitcodes, kernels
from .context import N_CLASSES, ClassMap

POSITION_BLOCKS = {"rice": 3, "mask": 1}
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
class RiceCode:
    groups: np.ndarray  # GROUP_DTYPE rows, one per (chunk, class) with any change
    unary: np.ndarray  # unpacked bits
    remainder: np.ndarray  # unpacked bits
    order: np.ndarray  # changed indices, in residual order

    @property
    def bits(self) -> int:
        return self.unary.size + self.remainder.size + self.groups.size * 8 * GROUP_DTYPE.itemsize


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


def rice_encode(changed_mask: np.ndarray, cmap: ClassMap, chunk: int) -> RiceCode:
    rows, unary, rem, order = [], [], [], []
    for ci, start in enumerate(range(0, changed_mask.size, chunk)):
        stop = min(changed_mask.size, start + chunk)
        part = changed_mask[start:stop]
        if not part.any():
            continue
        cls = cmap.classes(start, stop)
        chunk_order, ranks_all, counts = kernels.class_ranks(part, cls)
        order.append(chunk_order + start)
        for c, size, ranks in _chunk_groups(cls[chunk_order], ranks_all, counts):
            invert = 2 * ranks.size > size
            coded = _complement(ranks, size) if invert else ranks
            gaps = bitcodes.gaps_from_sorted(coded)
            k = bitcodes.best_rice_k(gaps)
            u, r = bitcodes.rice_encode(gaps, k)
            unary.append(u)
            rem.append(r)
            rows.append((ci, c, k, int(invert), 0, ranks.size))
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, np.uint8)  # noqa: E731
    return RiceCode(
        np.array(rows, dtype=GROUP_DTYPE),
        cat(unary),
        cat(rem),
        np.concatenate(order) if order else np.zeros(0, np.int64),
    )


def residual_classes(groups: np.ndarray) -> np.ndarray:
    """Context class of every residual, in residual order (class-major per chunk)."""
    return np.repeat(groups["cls"], groups["count"].astype(np.int64))


def rice_blocks(code: RiceCode, level: int) -> list[bytes]:
    cctx = zstandard.ZstdCompressor(level=level)
    return [
        cctx.compress(code.groups.tobytes()),
        np.packbits(code.unary).tobytes(),
        np.packbits(code.remainder).tobytes(),
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


def rice_decode(
    blocks: list[memoryview], n: int, cmap: ClassMap, chunk: int
) -> tuple[np.ndarray, np.ndarray]:
    """Changed indices in residual order and their classes; ValueError on any inconsistency."""
    groups = _unpack_groups(bytes(blocks[0]), n, chunk)
    unary = bitcodes.UnaryReader(np.unpackbits(np.frombuffer(blocks[1], dtype=np.uint8)))
    rem = np.unpackbits(np.frombuffer(blocks[2], dtype=np.uint8))
    out, r_off = [], 0
    for ci in np.unique(groups["chunk"]):
        start = int(ci) * chunk
        stop = min(n, start + chunk)
        cls = cmap.classes(start, stop)
        counts = kernels.class_counts(cls)
        classes, parts = [], []
        for g in groups[groups["chunk"] == ci]:
            c, size, m, k = int(g["cls"]), int(counts[g["cls"]]), int(g["count"]), int(g["k"])
            if m == 0 or m > size:
                raise ValueError("group count out of range")
            coded_n = size - m if g["invert"] else m
            q = unary.read(coded_n)
            r = bitcodes.fixed_decode(rem[r_off:], coded_n, k)
            r_off += coded_n * k
            ranks = bitcodes.sorted_from_gaps((q << np.uint64(k)) | r)
            if ranks.size and ranks[-1] >= size:
                raise ValueError("rank beyond its class")
            if g["invert"]:
                ranks = _complement(ranks, size)
            classes.append(c)
            parts.append(ranks)
        out.append(kernels.scatter_ranks(cls, np.array(classes), parts) + start)
    if -(-unary.bits_used // 8) != len(blocks[1]) or -(-r_off // 8) != len(blocks[2]):
        raise ValueError("position streams have unused bytes")
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
    limit = expected if expected is not None else 64 << 20
    try:
        declared = zstandard.frame_content_size(block)
        if declared > limit:
            raise ValueError(f"zstd frame declares {declared} bytes, more than the {limit} allowed")
        return zstandard.ZstdDecompressor().decompress(block, max_output_size=limit)
    except zstandard.ZstdError as e:
        raise ValueError(f"zstd: {e}") from None


decompress = _decompress
