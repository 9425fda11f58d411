"""One batch's pass through a backend: the layout and the cache, cut together.

Every operation the episode loop needs on a running batch (drop ended rows,
copy a prefilled prompt to a group's rows, put new rows in ended rows'
places, feed a long tool reply to its own rows, join two batches, compact
the pad columns) is written here once, as the same cut on the `Layout` and
on the backend's `Cache`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .backend import Backend
from .layout import Block, Layout
from .sampling import Draw, SamplingParams, sample


class Session:
    def __init__(self, backend: Backend, batch: int, pad_id: int):
        self.backend, self.pad_id = backend, pad_id
        self.layout = Layout(batch)
        self.cache = backend.new_cache(batch)

    @property
    def batch(self) -> int:
        return self.layout.real.shape[0]

    def step(self, chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Next-token logits [B, V] after feeding each row its chunk."""
        return self.backend.forward(self.cache, self._block(chunks), self.layout)

    def sample(
        self, chunks: Sequence[Sequence[int]], params: SamplingParams, draws: np.ndarray
    ) -> Draw:
        """Each row's next token after feeding it its chunk (`sampling.sample`).
        A backend whose logits are elsewhere (a pipeline's last stage, in
        another process) samples there, by its own `sample`."""
        own = getattr(self.backend, "sample", None)
        if own is None:
            return sample(self.step(chunks), params, draws)
        return own(self.cache, self._block(chunks), self.layout, params, draws)

    def _block(self, chunks: Sequence[Sequence[int]]) -> Block:
        index = self.layout.compact()
        if index is not None:
            self.cache.gather(index)
        return self.layout.block(chunks, self.pad_id)

    def keep(self, rows: list[int]) -> None:
        """Only these rows (indices into the rows, possibly repeated) go on."""
        index = self.layout.keep(rows)
        self.cache.select(index, self.layout.trim())

    def take(self, rows: list[int]) -> Session:
        """A new session holding copies of these rows."""
        out = Session(self.backend, 0, self.pad_id)
        out.layout = self.layout.take(rows)
        drop = out.layout.trim()
        if not self.cache.empty:
            out.cache = self.cache.rows(np.asarray(rows, dtype=np.int64), drop)
        else:
            out.cache = self.backend.new_cache(len(rows))
        return out

    def place(self, slots: list[int], other: Session) -> bool:
        """`other`'s rows into these rows (ended episodes'), in place; False,
        nothing done, when `other` holds more columns than this session."""
        width, theirs = self.layout.width, other.layout.width
        if theirs > width:
            return False
        self.layout.place(slots, other.layout)
        if theirs:  # rows that have not run yet (no prefill) have nothing cached
            self.cache.write(np.asarray(slots, dtype=np.int64), other.cache, width - theirs)
        return True

    def feed(self, rows: list[int], chunks: Sequence[Sequence[int]]) -> None:
        """Feed these rows their chunks (no logits): they run on a copy of
        those rows alone, and the columns they make are appended to every
        row, real for these rows and pad for the rest (the compaction drops
        them when they pile up)."""
        part = self.take(rows)
        part.step(chunks)
        width = max(len(c) for c in chunks)
        self.layout.append(rows, part.layout, width)
        self.cache.append(np.asarray(rows, dtype=np.int64), part.cache, width)

    def extend(self, other: Session) -> None:
        """Take on `other`'s rows (a session of the same backend, prefilled)."""
        pad_self, pad_other = self.layout.extend(other.layout)
        self.cache.join(other.cache, pad_self, pad_other)

    def extend_all(self, others: Sequence[Session]) -> None:
        """Take on every one of `others`' rows at once, into one buffer made
        once (a backend whose cache can `stack`; see `loop._concat`)."""
        pads = self.layout.extend_all([o.layout for o in others])
        self.cache.stack([o.cache for o in others], pads)
