"""Which cache columns hold real tokens, and each row's next position.

A batch's rows take chunks of different lengths every step (a tool reply
joins one row, not the others), so pad columns sit anywhere in a row: left
padding of a shorter chunk, the columns another row's reply added, the older
columns of an ended row whose place a new one took. Every backend keeps
every column and masks the pads out of every query; this module is the
bookkeeping all of them share. It works on numpy arrays, which every
backend takes without a copy (torch.from_numpy, mx.array).

Pad columns sit inside rows, so a sliding-window layer cannot count cache
columns: a windowed layer's mask admits the keys within its window of the
query in real-token positions (the same as a teacher-forced pass over the
row alone).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

# Pad columns a cache may carry before `Layout.compact` removes them (and at
# least a quarter of its width): each compaction copies the whole cache once.
COMPACT_MIN = 32


@dataclass(frozen=True)
class Block:
    """One step's input, as every backend takes it.

    ids and positions are [B, W] int64; `allowed` is the mask [B, 1, W, past + W]
    (True: the query may see the key), or None while no row has ever been
    padded: plain causal attention, which backends run on their fast path.
    """

    ids: np.ndarray
    positions: np.ndarray
    allowed: np.ndarray | None


class Layout:
    """Which cache columns are real tokens ([B, columns] bool), and each row's next position."""

    def __init__(self, batch: int):
        self.real = np.zeros((batch, 0), dtype=bool)
        self.pos = np.zeros(batch, dtype=np.int64)
        self.padded = False  # has any pad column entered the cache?

    @property
    def width(self) -> int:
        return self.real.shape[1]

    def block(self, chunks: Sequence[Sequence[int]], pad_id: int) -> Block:
        """This step's block: each row's chunk right-aligned, the layout advanced past it."""
        if not self.padded and len({len(c) for c in chunks}) == 1:
            return self._dense(chunks)
        self.padded = True
        lens = np.array([len(c) for c in chunks], dtype=np.int64)
        batch, width = len(chunks), int(lens.max())
        ids = np.full((batch, width), pad_id, dtype=np.int64)
        for i, c in enumerate(chunks):
            ids[i, width - len(c) :] = c
        offset = width - lens  # pads before each row's chunk
        col = np.arange(width)
        new_real = col[None, :] >= offset[:, None]
        positions = np.maximum(self.pos[:, None] + col[None, :] - offset[:, None], 0)
        past = self.width
        keys = np.concatenate([self.real, new_real], axis=1)  # [B, past + W]
        causal = np.ones((width, past + width), dtype=bool)
        causal[:, past:] = np.tril(causal[:, past:])
        allowed = keys[:, None, :] & causal[None]
        # A pad query sees only itself: a row with no visible key would turn
        # into NaNs in the cache. Real queries never see pad keys.
        allowed[:, col, past + col] = True
        self.real, self.pos = keys, self.pos + lens
        return Block(ids, positions, allowed[:, None])

    def _dense(self, chunks: Sequence[Sequence[int]]) -> Block:
        width = len(chunks[0])
        ids = np.array(chunks, dtype=np.int64).reshape(len(chunks), width)
        positions = self.pos[:, None] + np.arange(width)[None, :]
        ones = np.ones((len(chunks), width), dtype=bool)
        self.real, self.pos = np.concatenate([self.real, ones], axis=1), self.pos + width
        return Block(ids, positions, None)

    def windowed(self, allowed: np.ndarray, window: int) -> np.ndarray:
        """`allowed` (this step's block mask) narrowed to keys fewer than `window`
        real tokens behind each query: positions count real tokens, not columns."""
        width = allowed.shape[-2]
        kpos = self.real.cumsum(axis=1)  # [B, keys]: real tokens up to each column
        near = kpos[:, -width:, None] - kpos[:, None, :] < window
        return allowed & near[:, None]

    def keep(self, rows: list[int]) -> np.ndarray:
        """Only these rows go on (an index may repeat: rows sharing a prefix)."""
        index = np.asarray(rows, dtype=np.int64)
        self.real, self.pos = self.real[index], self.pos[index]
        return index

    def take(self, rows: list[int]) -> Layout:
        """A new layout holding copies of these rows."""
        index = np.asarray(rows, dtype=np.int64)
        out = Layout(len(rows))
        out.real, out.pos, out.padded = self.real[index], self.pos[index], self.padded
        return out

    def place(self, slots: list[int], other: Layout) -> None:
        """`other`'s rows into these rows (ended episodes'), right-aligned on
        this layout's columns, which must be at least as many as `other`'s."""
        index = np.asarray(slots, dtype=np.int64)
        width, theirs = self.width, other.width
        self.real[index] = False
        self.real[index, width - theirs :] = other.real
        self.pos[index] = other.pos
        self.padded = self.padded or other.padded or theirs < width

    def append(self, rows: list[int], other: Layout, width: int) -> None:
        """`width` new columns for every row: `other`'s last ones for these
        rows (`other` holds copies of them, fed since), pad for the rest."""
        index = np.asarray(rows, dtype=np.int64)
        new = np.zeros((self.real.shape[0], width), dtype=bool)
        new[index] = other.real[:, -width:]
        self.real = np.concatenate([self.real, new], axis=1)
        self.pos[index] = other.pos
        self.padded = True

    def extend(self, other: Layout) -> tuple[int, int]:
        """Append `other`'s rows, both right-aligned on the longer past.

        Returns the pad columns to put before this layout's cache and before
        `other`'s, which the backend adds to its own arrays.
        """
        pad_a, pad_b = self.extend_all([other])
        return pad_a, pad_b

    def extend_all(self, others: Sequence[Layout]) -> list[int]:
        """Append every one of `others`' rows at once, all right-aligned on
        the longest past (what extending by each in turn, or in pairs, ends
        with). Returns the pad columns before each cache, this one's first."""
        parts = [self, *others]
        width = max(p.width for p in parts)
        pads = [width - p.width for p in parts]
        self.real = np.concatenate(
            [np.pad(p.real, ((0, 0), (pad, 0))) for p, pad in zip(parts, pads, strict=True)]
        )
        self.pos = np.concatenate([p.pos for p in parts])
        self.padded = any(p.padded for p in parts) or any(pads)
        return pads

    def compact(self) -> np.ndarray | None:
        """Drop the pad columns no row needs, once they are a quarter of the cache.

        Each row's real columns move, in order, to the right of a cache as
        wide as the row with the most real tokens; returns the column index
        [B, new width] to gather every layer's keys and values by (None when
        nothing moves). A tool reply pads every other row by its length and
        a refilled batch never starts afresh, so without this the cache, and
        the attention and mask over it, grow by every reply of every episode
        the batch has held. Positions are kept (`pos`, and windows count real
        columns in order), so no query sees anything else.
        """
        width = self.width
        need = int(self.real.sum(axis=1).max()) if width else 0
        if width == need or width - need < max(COMPACT_MIN, width // 4):
            return None
        # A stable sort puts each row's pads first and its real columns after
        # them, both in their order; the last `need` are the row right-aligned.
        order = np.argsort(self.real, axis=1, kind="stable")
        index = order[:, width - need :]
        self.real = np.take_along_axis(self.real, index, axis=1)
        self.padded = bool((~self.real).any())
        return index

    def trim(self) -> int:
        """Drop the leading cache columns no row uses any more; how many."""
        used = self.real.any(axis=0)
        if used.size == 0 or used[0]:
            return 0
        first = int(used.argmax()) if used.any() else used.size
        self.real = self.real[:, first:]
        return first
