"""Coding the positions of changed elements.

Two codes, the cheaper chosen per tensor:

- "rice": per chunk of the flattened tensor, elements are ordered by context
  class (stable), and within each class the ranks of changed elements are
  gap-coded with a Rice code whose parameter fits that class's density. Where
  more than half of a class changed, the unchanged ranks are coded instead.
  Gaps of a geometric source are what Rice codes are near-optimal for, and the
  split into quotient and remainder streams decodes without a sequential loop.
- "mask": a bitmask over the whole tensor, zstd-compressed; for dense changes.

Both are built and read a chunk at a time (memory), and both give the changed
indices in the order the residuals are stored: class major within each chunk
for "rice", ascending for "mask".
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import numpy as np
import zstandard

from colonnade import untrusted

from . import bitcodes, kernels, parallel, rice
from .context import N_CLASSES, ClassMap

# Slices a bitmask is unpacked in (a multiple of 8: whole bytes).
MASK_STEP = 1 << 22
# A group: one (chunk, class) with changes. In memory a row of this table;
# on the wire column after column (`pack_groups`).
GROUP_DTYPE = np.dtype(
    [
        ("chunk", "<u4"),
        ("cls", "u1"),
        ("k", "u1"),
        ("invert", "u1"),
        ("count", "<u4"),
        # An inverted group's unchanged elements (the ranks it codes), else
        # 0: with count, its class size, which the decoder would otherwise
        # have to count in a pass over the chunk before reading the streams.
        ("kept", "<u4"),
    ]
)
_COUNT = np.dtype("<u4")


def pack_groups(g: np.ndarray) -> bytes:
    """The group table's wire form (before zstd): its row count (u32), then
    column by column: chunk as the difference from the row before, cls, k,
    invert, count, and kept for the inverted rows only; the u32 columns
    plane by plane (`bitcodes.byte_planes`), which zstd compresses better than
    the rows written out (on the SmolLM2 patches of docs/benchmarks.md)."""
    steps = g["chunk"].astype(_COUNT)  # (np.diff with prepend cost more than the rest)
    steps[1:] -= g["chunk"][:-1]
    kept = g["kept"][g["invert"] != 0].astype(_COUNT)
    return b"".join(
        [
            np.array([g.size], _COUNT).tobytes(),
            bitcodes.byte_planes(steps),
            g["cls"].tobytes(),
            g["k"].tobytes(),
            g["invert"].tobytes(),
            bitcodes.byte_planes(g["count"].astype(_COUNT)),
            bitcodes.byte_planes(kept),
        ]
    )


def unpack_groups(raw: bytes) -> np.ndarray:
    """`pack_groups` read back; ValueError where the lengths do not add up."""
    return _as_groups(rice.group_table(raw))


def _as_groups(table: np.ndarray) -> np.ndarray:
    g = np.empty(table.shape[0], GROUP_DTYPE)
    for col, name in enumerate(GROUP_DTYPE.names):
        g[name] = table[:, col]
    return g


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


def chunk_bounds(n: int, chunk: int):
    """(chunk number, start, stop) over a flattened tensor of n elements."""
    for ci, start in enumerate(range(0, n, chunk)):
        yield ci, start, min(n, start + chunk)


class RiceEncoder:
    """The "rice" position code of one tensor, built chunk by chunk.

    Each chunk's ranks are Rice-coded as soon as they are known and kept as
    packed bits, so the memory beyond the tensors is one chunk's working set
    plus the (small) output, never index arrays over the whole tensor.
    """

    def __init__(self, cmap: ClassMap | None) -> None:
        self.cmap = cmap
        self._rows: list[tuple[int, int, int, int, int, int]] = []
        self._unary: rice.BitWriter | bitcodes.BitSink
        self._rem: rice.BitWriter | bitcodes.BitSink
        if rice.COMPILED:
            self._unary, self._rem = rice.BitWriter(), rice.BitWriter()
        else:
            self._unary, self._rem = bitcodes.BitSink(), bitcodes.BitSink()

    def add(self, ci: int, start: int, new: np.ndarray) -> np.ndarray:
        """Code the changes of one chunk (new: its new bits over the base's).

        Returns the chunk-local indices of its changes in residual order
        (empty if nothing changed, and then nothing is coded).
        """
        return self.code(ci, self.changes(start, new))

    def changes(self, start: int, new: np.ndarray, key: int | None = None) -> tuple:
        """The element pass over one chunk (any thread): kernels.class_ranks."""
        stop = start + new.size
        return kernels.class_ranks(
            self.cmap.bits[start:stop],
            new,
            self.cmap.source(start, stop),
            lambda: self.cmap.classes(start, stop),
            key=key,
        )

    def code(self, ci: int, found: tuple) -> np.ndarray:
        """Code chunk ci's `changes` (chunks in order); its changes in residual order."""
        order, ranks_all, counts, per_class = found[:4]
        if rice.COMPILED:
            rows = rice.encode_chunk(ranks_all, per_class, counts, self._unary, self._rem)
            self._rows.extend((ci, c, k, inv, m, kept) for c, k, inv, m, kept in rows.tolist())
            return order
        order_cls = np.repeat(np.arange(N_CLASSES, dtype=np.uint8), per_class)
        for c, size, ranks in _chunk_groups(order_cls, ranks_all, counts):
            invert = 2 * ranks.size > size
            gaps = bitcodes.gaps_from_sorted(_complement(ranks, size) if invert else ranks)
            k = bitcodes.best_rice_k(gaps)
            unary, rem = bitcodes.rice_encode(gaps, k)
            self._unary.add(unary)
            self._rem.add(rem)
            kept = size - ranks.size if invert else 0
            self._rows.append((ci, c, k, int(invert), ranks.size, kept))
        return order

    @property
    def groups(self) -> np.ndarray:
        return np.array(self._rows, dtype=GROUP_DTYPE)

    def blocks(self, level: int) -> list[bytes]:
        """[groups, unary quotients, remainders]."""
        table = compress(pack_groups(self.groups), level)
        return [table, self._unary.getvalue(), self._rem.getvalue()]


def residual_classes(groups: np.ndarray) -> np.ndarray:
    """Context class of every residual, in residual order (class-major per chunk)."""
    return np.repeat(groups["cls"], groups["count"].astype(np.int64))


def read_groups(block: memoryview, n: int, chunk: int) -> np.ndarray:
    """The checked group table of a "rice" code; ValueError if inconsistent
    (out of range, out of order, or a group larger than its chunk: checked
    before anything is sized by the counts)."""
    return _as_groups(rice.group_table(_decompress(bytes(block), None), n, chunk, check=True))


class _RiceReader:
    """Reads the groups of one chunk after another off the two streams."""

    def __init__(self, blocks: list[memoryview]) -> None:
        self.blocks = blocks
        self.unary_bytes = np.frombuffer(blocks[0], np.uint8)
        self.unary = bitcodes.UnaryReader(self.unary_bytes)
        self.rem = np.frombuffer(blocks[1], dtype=np.uint8)
        self.r_off = 0

    def read(self, count: int, k: int) -> np.ndarray:
        q = self.unary.read(count)
        if self.r_off + count * k > 8 * self.rem.size:
            raise ValueError("remainder stream ends early")
        r = bitcodes.fixed_decode(bitcodes.unpack_bits(self.rem, self.r_off, count * k), count, k)
        self.r_off += count * k
        return (q << np.uint64(k)) | r

    def read_chunk(self, rows: np.ndarray, limit: int) -> kernels.Wanted:
        """The changed ranks of one chunk's group rows (a chunk of `limit` elements)."""
        if rice.COMPILED:
            table = np.stack(
                [rows["cls"], rows["k"], rows["invert"], rows["count"], rows["kept"]], axis=1
            ).astype(np.int64)
            want, self.unary.bits_used, self.r_off = rice.decode_chunk(
                self.unary_bytes, self.unary.bits_used, self.rem, self.r_off, table, limit
            )
            return kernels.Wanted.flat(table[:, 0], table[:, 3], want)
        classes, parts = [], []
        for g in rows:
            c, m, kept = int(g["cls"]), int(g["count"]), int(g["kept"])
            size = m + kept if g["invert"] else limit
            if m == 0 or m > size or size > limit:
                raise ValueError("group count out of range")
            coded_n = kept if g["invert"] else m
            ranks = bitcodes.sorted_from_gaps(self.read(coded_n, int(g["k"])))
            if ranks.size and ranks[-1] >= size:
                raise ValueError("rank beyond its class")
            classes.append(c)
            parts.append(_complement(ranks, size) if g["invert"] else ranks)
        return kernels.Wanted.of(classes, parts)

    def check_used(self) -> None:
        if -(-self.unary.bits_used // 8) != len(self.blocks[0]) or -(-self.r_off // 8) != len(
            self.blocks[1]
        ):
            raise ValueError("position streams have unused bytes")


@dataclass(frozen=True)
class Rebuild:
    """What rice_chunks needs to also rebuild each chunk's changes (apply)."""

    values: np.ndarray  # every change's residual, in residual order
    dst: np.ndarray  # where the new bits go: the base's bits (in place) or a copy
    res: int  # kernels.RES_*
    key: int  # kernels.KEY_*
    # In place: each chunk logs (dst, start, indices, old bits) here as soon as
    # it is rebuilt, on the thread that rebuilt it, so that a failure later
    # (in another chunk, or reading the stream) can put every one back.
    undo: list | None = None


def rice_chunks(
    groups: np.ndarray,
    blocks: list[memoryview],
    n: int,
    cmap: ClassMap,
    chunk: int,
    rebuild: Rebuild | None = None,
):
    """Per chunk with changes: (start, chunk-local changed indices in residual order),
    and with `rebuild`, their old bits too, the chunk's new bits written to
    rebuild.dst (every element of the chunk).

    One chunk at a time, so a decoder never holds index arrays over the whole
    tensor. The streams are read in chunk order on this thread; the element
    passes that turn ranks into indices run on every core
    (`parallel.ordered`). ValueError on any inconsistency (raised once all
    chunks are read for unused stream bytes).
    """
    reader = _RiceReader(blocks)
    yield from parallel.ordered(_chunk_passes(groups, reader, n, cmap, chunk, rebuild))
    reader.check_used()


def _chunk_passes(groups, reader: _RiceReader, n: int, cmap: ClassMap, chunk: int, rebuild):
    """Per chunk with changes, in order: its ranks read, and a thunk that finds their indices."""
    chunk_ids = np.unique(groups["chunk"])
    done = 0
    for ci in chunk_ids:
        start = int(ci) * chunk
        stop = min(n, start + chunk)
        # The numpy path computes the chunk's classes once, on first request.
        cache: list[np.ndarray] = []

        def classes_fn(start=start, stop=stop, cache=cache):
            if not cache:
                cache.append(cmap.classes(start, stop))
            return cache[0]

        bits, src = cmap.bits[start:stop], cmap.source(start, stop)
        rows = groups[groups["chunk"] == ci]
        wanted = reader.read_chunk(rows, stop - start)
        if rebuild is None:
            yield functools.partial(_located, start, stop - start, bits, src, classes_fn, wanted)
            continue
        m = wanted.want.size
        if done + m > rebuild.values.size:
            raise ValueError(f"positions hold more changes than the {rebuild.values.size} coded")
        yield functools.partial(
            _rebuilt,
            start,
            bits,
            rebuild.dst[start:stop],
            src,
            classes_fn,
            wanted,
            rebuild.values[done : done + m],
            rebuild,
        )
        done += m


def _located(start, n, bits, src, classes_fn, wanted):
    return start, kernels.scatter_ranks(n, bits, src, classes_fn, wanted)


def _rebuilt(start, bits, dst, src, classes_fn, wanted, values, rebuild: Rebuild):
    local, before = kernels.scatter_rebuild(
        bits.size, bits, dst, src, classes_fn, wanted, values, rebuild.res, rebuild.key
    )
    if rebuild.undo is not None:
        rebuild.undo.append((rebuild.dst, start, local, before))
    return start, local, before


def mask_block(packed: list[np.ndarray], level: int) -> bytes:
    """The "mask" code from each chunk's np.packbits (chunks a multiple of 8 long)."""
    return compress(b"".join(p.tobytes() for p in packed), level)


def mask_chunks(block: memoryview, n: int):
    """Per slice of the tensor with changes: (start, slice-local changed indices, ascending)."""
    raw = _decompress(bytes(block), -(-n // 8))
    if len(raw) != -(-n // 8):
        raise ValueError("bitmask has the wrong length")
    packed = np.frombuffer(raw, dtype=np.uint8)
    for _, start, stop in chunk_bounds(n, MASK_STEP):
        bits = np.unpackbits(packed[start // 8 : -(-stop // 8)], count=stop - start)
        local = np.flatnonzero(bits)
        if local.size:
            yield start, local


_local = threading.local()


def compress(data: bytes, level: int) -> bytes:
    """zstd at `level`, with this thread's context for that level (making a
    context costs more than compressing a small block; they are not
    thread-safe)."""
    cctx = getattr(_local, "cctx", None)
    if cctx is None:
        cctx = _local.cctx = {}
    if level not in cctx:
        cctx[level] = zstandard.ZstdCompressor(level=level)
    return cctx[level].compress(data)


def _decompress(block: bytes, expected: int | None) -> bytes:
    # A full tensor's limit is its declared shape (up to 2^48 elements).
    return untrusted.decompress(block, expected if expected is not None else 64 << 20)


decompress = _decompress
