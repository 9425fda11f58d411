"""What a backend gives the episode loop: a forward pass and a KV cache it can cut.

A backend is one file (`torch_backend.py`, `mlx_backend.py`) with two classes:

`Backend` runs the network. It is made from a published state (int8 codes
and row scales, or floats) by the loader (`loader.py`), takes newer states
in place (`refresh`: a PULSE patch changes a few tensors), makes empty
caches (`new_cache`) and runs one step (`forward`): a `Block` of token ids,
their positions and the attention mask in, the next-token logits of each
row's last column out, the cache grown by the block's columns.

`Cache` is one batch's keys and values, every layer's, [rows, heads,
columns, dim]. The session (`session.py`) decides what to cut, copy and
join, in the same columns as its `Layout`; the backend only moves arrays:

- `rows(index, drop)`: a new cache of copies of these rows (an index may
  repeat), without the first `drop` columns;
- `select(index, drop)`: the same, in place;
- `write(slots, other, start)`: `other`'s columns into rows `slots` at
  columns start .. start + other's width (the rest of those rows stays,
  masked out);
- `append(rows, other, width)`: `width` new columns for every row, `other`'s
  last `width` for `rows`, zeros for the others;
- `join(other, pad_self, pad_other)`: `other`'s rows after these, each side
  left-padded with zero columns first;
- `gather(index)`: for each row b, only columns index[b] ([B, new width]);
- `empty`: True until a forward pass has written anything.

Masks: `Block.allowed` is None while no row was ever padded (plain causal
attention: use the backend's fast path), else the full mask of this step;
a sliding-window layer narrows it with `Layout.windowed` (windows count
real tokens, not columns), so no column is ever dropped from a layer and
rows of any model can be cut, copied and joined.

A backend whose logits live elsewhere (a pipeline, whose last stage is
another process) also provides `sample(cache, block, layout, params,
draws)`, returning the `sampling.Draw` its last stage made with the run's
rule; the session calls it in place of `forward` and `sampling.sample`.

A new backend passes `tests/engine/test_backends.py` (the same episodes,
log-probs against teacher forcing, refill and compaction) by adding itself
to that suite's list. A backend that manages its own cache (a server that
batches internally) would plug in above this, at `Engine.run` (the episode
source every caller goes through: `generate`, the OpenAI endpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping, Set

    import numpy as np
    import torch

    from .layout import Block, Layout


class BackendUnavailable(RuntimeError):
    """A backend's libraries are not installed, or not importable, on this machine."""


class UnsupportedArchitecture(ValueError):
    """A backend does not run this model's architecture."""


class Cache(Protocol):
    @property
    def empty(self) -> bool: ...

    def rows(self, index: np.ndarray, drop: int) -> Cache: ...

    def select(self, index: np.ndarray, drop: int) -> None: ...

    def write(self, slots: np.ndarray, other: Cache, start: int) -> None: ...

    def append(self, rows: np.ndarray, other: Cache, width: int) -> None: ...

    def join(self, other: Cache, pad_self: int, pad_other: int) -> None: ...

    def gather(self, index: np.ndarray) -> None: ...

    # Optional: every one of `others`' rows after these, in one buffer made
    # once, each padded before by its `pads` columns (these rows' first).
    # A cache without it is joined in pairs (`loop._concat`).
    # def stack(self, others: list[Cache], pads: list[int]) -> None: ...


class Backend(Protocol):
    name: str  # what a rollout batch records as its engine

    def new_cache(self, batch: int) -> Cache: ...

    def forward(self, cache: Cache, block: Block, layout: Layout) -> torch.Tensor:
        """Next-token logits [B, V] of each row's last column (a torch tensor)."""
        ...

    def refresh(self, state: Mapping[str, torch.Tensor], changed: Set[str] | None) -> None:
        """A newer published state, in place: the `changed` keys only (None: all)."""
        ...
