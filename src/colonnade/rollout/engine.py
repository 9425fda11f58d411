"""Batched multi-turn generation with one KV cache for many episodes.

Each step feeds every live episode one chunk: its last sampled token, or
that token followed by the environment's reply when a turn has just ended
(the prompt is the first chunk). Chunks are right-aligned in a [B, W] block;
the left padding is stored in the cache but masked out of every later query,
so an episode extends its own KV prefix and is never recomputed, and the
episodes of a batch end independently (finished rows leave the cache).

Pad columns sit inside rows (left padding, and the pads before each shorter
chunk), so a sliding-window layer cannot count cache columns: every layer
keeps every column, and a windowed layer's mask admits the keys within its
window of the query in real-token positions (the same as a teacher-forced
pass over the row alone).
"""

from __future__ import annotations

import functools
import inspect
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch

from colonnade.protocol.turns import StopMatcher

from .sampling import SamplingParams, sample

# turn text (up to its stop string) -> environment text to append, or None to end
Responder = Callable[[str], "str | None"]


@dataclass
class Episode:
    """Everything the trainer needs of one episode, token by token."""

    prompt_ids: list[int]
    version: int
    tokens: list[int] = field(default_factory=list)  # after the prompt
    from_model: list[bool] = field(default_factory=list)  # env tokens never enter the loss
    logprobs: list[float] = field(default_factory=list)  # behaviour log-prob; 0.0 on env tokens
    turns: list[str] = field(default_factory=list)  # each model turn's text
    finish: str = ""  # "done" (env ended it), "eos", "length"

    def add(self, ids: Sequence[int], model: bool, logprobs: Sequence[float] | None = None):
        self.tokens.extend(ids)
        self.from_model.extend([model] * len(ids))
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(ids))


@dataclass
class _Row:
    episode: Episode
    respond: Responder
    pending: list[int]
    turn: list[int] = field(default_factory=list)


class Layout:
    """Which cache columns are real tokens, and each row's next position.

    Engine-neutral bookkeeping (torch tensors on `device`): a backend turns
    the block it returns into its own arrays.
    """

    def __init__(self, batch: int, device: torch.device):
        self.real = torch.zeros((batch, 0), dtype=torch.bool, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.device = device
        self.padded = False  # has any pad column entered the cache?

    def block(self, chunks: Sequence[Sequence[int]], pad_id: int):
        """input ids [B, W], position ids [B, W] and the mask [B, 1, W, past + W].

        The mask is None while no row has ever been padded: then it is plain
        causal attention over the cache, which the backends do on their own
        fast path (a batch of equal prompts, or a single episode, never pads).
        """
        if not self.padded and len({len(c) for c in chunks}) == 1:
            return self._dense(chunks)
        self.padded = True
        lens = torch.tensor([len(c) for c in chunks], device=self.device)
        batch, width = len(chunks), int(lens.max())
        ids = torch.full((batch, width), pad_id, dtype=torch.long)
        for i, c in enumerate(chunks):
            ids[i, width - len(c) :] = torch.tensor(c, dtype=torch.long)
        offset = width - lens  # pads before each row's chunk
        col = torch.arange(width, device=self.device)
        new_real = col[None, :] >= offset[:, None]
        positions = (self.pos[:, None] + col[None, :] - offset[:, None]).clamp_(min=0)
        past = self.real.shape[1]
        keys = torch.cat([self.real, new_real], dim=1)  # [B, past + W]
        causal = torch.ones((width, past + width), dtype=torch.bool, device=self.device)
        causal[:, past:] = torch.tril(causal[:, past:])
        allowed = keys[:, None, :] & causal[None]
        # A pad query sees only itself: a row with no visible key would turn
        # into NaNs in the cache. Real queries never see pad keys.
        diag = torch.arange(width, device=self.device)
        allowed[:, diag, past + diag] = True
        self.real, self.pos = keys, self.pos + lens
        return ids.to(self.device), positions, allowed[:, None]

    def windowed(self, allowed: torch.Tensor, window: int) -> torch.Tensor:
        """`allowed` (this step's block mask) narrowed to keys fewer than `window`
        real tokens behind each query: positions count real tokens, not columns."""
        width = allowed.shape[-2]
        kpos = self.real.long().cumsum(dim=1)  # [B, keys]: real tokens up to each column
        near = kpos[:, -width:, None] - kpos[:, None, :] < window
        return allowed & near[:, None]

    def _dense(self, chunks: Sequence[Sequence[int]]):
        width = len(chunks[0])
        ids = torch.tensor(chunks, dtype=torch.long, device=self.device)
        positions = self.pos[:, None] + torch.arange(width, device=self.device)[None, :]
        ones = torch.ones((len(chunks), width), dtype=torch.bool, device=self.device)
        self.real, self.pos = torch.cat([self.real, ones], dim=1), self.pos + width
        return ids, positions, None

    def keep(self, rows: list[int]) -> torch.Tensor:
        """Only these rows go on (an index may repeat: rows sharing a prefix)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        self.real, self.pos = self.real[index], self.pos[index]
        return index

    def take(self, rows: list[int]) -> Layout:
        """A new layout holding copies of these rows."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        out = Layout(len(rows), self.device)
        out.real, out.pos, out.padded = self.real[index], self.pos[index], self.padded
        return out

    def place(self, slots: list[int], other: Layout) -> None:
        """`other`'s rows into these rows (ended episodes'), right-aligned on
        this layout's columns, which must be at least as many as `other`'s."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        width, theirs = self.real.shape[1], other.real.shape[1]
        self.real[index] = False
        self.real[index, width - theirs :] = other.real
        self.pos[index] = other.pos
        self.padded = self.padded or other.padded or theirs < width

    def append(self, rows: list[int], other: Layout, width: int) -> None:
        """`width` new columns for every row: `other`'s last ones for these
        rows (`other` holds copies of them, fed since), pad for the rest."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        new = torch.zeros((self.real.shape[0], width), dtype=torch.bool, device=self.device)
        new[index] = other.real[:, -width:]
        self.real = torch.cat([self.real, new], dim=1)
        self.pos[index] = other.pos
        self.padded = True

    def extend(self, other: Layout) -> tuple[int, int]:
        """Append `other`'s rows, both right-aligned on the longer past.

        Returns the pad columns to put before this layout's cache and before
        `other`'s, which the backend adds to its own arrays.
        """
        a, b = self.real.shape[1], other.real.shape[1]
        pad_a, pad_b = max(b - a, 0), max(a - b, 0)
        self.real = torch.cat(
            [
                torch.nn.functional.pad(self.real, (pad_a, 0)),
                torch.nn.functional.pad(other.real, (pad_b, 0)),
            ]
        )
        self.pos = torch.cat([self.pos, other.pos])
        self.padded = self.padded or other.padded or pad_a > 0 or pad_b > 0
        return pad_a, pad_b

    def compact(self) -> torch.Tensor | None:
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
        width = self.real.shape[1]
        need = int(self.real.sum(dim=1).max()) if width else 0
        if width - need < max(_COMPACT_MIN, width // 4):
            return None
        # A stable sort puts each row's pads first and its real columns after
        # them, both in their order; the last `need` are the row right-aligned.
        order = torch.sort(self.real.to(torch.uint8), dim=1, stable=True).indices
        index = order[:, width - need :]
        self.real = self.real.gather(1, index)
        self.padded = bool((~self.real).any())
        return index

    def trim(self) -> int:
        """Drop the leading cache columns no row uses any more; how many."""
        used = self.real.any(dim=0)
        if used.numel() == 0 or bool(used[0]):
            return 0
        first = int(used.int().argmax()) if bool(used.any()) else used.numel()
        self.real = self.real[:, first:]
        return first


# Pad columns a cache may carry before `Layout.compact` removes them (and at
# least a quarter of its width): each compaction copies the whole cache once.
_COMPACT_MIN = 32


class Session(Protocol):
    """One batch's pass through a backend: a KV cache that grows step by step."""

    def step(self, chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Next-token logits [B, V] after feeding each live row its chunk."""
        ...

    def keep(self, rows: list[int]) -> None:
        """Only these rows (indices into the live rows, possibly repeated) go on."""
        ...

    def extend(self, other: Session) -> None:
        """Take on `other`'s rows (a session of the same backend, prefilled)."""
        ...


@runtime_checkable
class Reusing(Session, Protocol):
    """A session that can copy rows out and write rows in place (optional:
    without it the engine prefills every admission and re-joins the cache)."""

    def take(self, rows: list[int]) -> Reusing:
        """A new session holding copies of these rows."""
        ...

    def place(self, slots: list[int], other: Session) -> bool:
        """`other`'s rows into these rows, in place; False (nothing done) when
        `other` holds more columns than this session."""
        ...


@runtime_checkable
class Feeding(Session, Protocol):
    """A session that can feed some rows a chunk while the others wait
    (optional: without it every row of a step is padded to the longest chunk)."""

    def feed(self, rows: list[int], chunks: Sequence[Sequence[int]]) -> None:
        """Feed these rows their chunks (no logits); the other rows gain only
        pad columns."""
        ...


# A step whose longest chunk (a tool reply) is at least this long, beside rows
# fed one token, feeds the long chunks to their own rows first: padded into
# the step, every other row would run that many pad tokens through the model.
_SPLIT_MIN = 8


def _split_replies(session: Session, live: list[_Row]) -> None:
    """Feed the rows whose pending chunk is long (a tool reply) all but its
    last token on their own, so the step that follows is one token a row."""
    long = [i for i, r in enumerate(live) if len(r.pending) > 1]
    if not long or len(long) == len(live) or not isinstance(session, Feeding):
        return
    if max(len(live[i].pending) for i in long) < _SPLIT_MIN:
        return
    session.feed(long, [live[i].pending[:-1] for i in long])
    for i in long:
        live[i].pending = live[i].pending[-1:]


def _admitted(waiting: deque, rows: list[_Row], busy: int, max_rows: int) -> list[_Row]:
    """The rows that start now: waiting units taken in order while there is
    room (a unit may start in part: what is left of it stays first in line)."""
    admit: list[_Row] = []
    while waiting and (not max_rows or busy + len(admit) < max_rows):
        unit = waiting[0]
        take = len(unit) if not max_rows else max_rows - busy - len(admit)
        admit.extend(rows[i] for i in unit[:take])
        if take >= len(unit):
            waiting.popleft()
        else:
            waiting[0] = unit[take:]
    return admit


@functools.cache
def _growing_layer():
    """A full-attention cache layer whose columns live in a buffer with room
    to spare: a step writes its new columns in place, where transformers'
    `DynamicLayer` concatenates and so copies the whole cache every step
    (a large share of a decode step: docs/benchmarks.md, issue 23).

    `keys`/`values` are views of the first `length` columns; the session's
    own surgery (cutting, padding and joining columns) goes through `assign`
    or `drop_front`. Built lazily: transformers is imported only with torch.
    """
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states) -> None:
            super().lazy_initialization(key_states, value_states)
            self._k = self._v = None

        def assign(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
            """Hold these columns, with space for `room` more before copying again."""
            b, h, t, d = keys.shape
            self._k = keys.new_empty((b, h, t + room, d))
            self._v = values.new_empty((b, values.shape[1], t + room, values.shape[-1]))
            self._k[:, :, :t], self._v[:, :, :t] = keys, values
            self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]

        def gather(self, index: torch.Tensor) -> None:
            """Keep, for each row b, columns index[b] (`Layout.compact`)."""
            at = index[:, None, :, None]
            keys, values = self.keys, self.values
            self.assign(
                keys.gather(2, at.expand(-1, keys.shape[1], -1, keys.shape[3])),
                values.gather(2, at.expand(-1, values.shape[1], -1, values.shape[3])),
                _ROOM,
            )

        def drop_front(self, columns: int) -> None:
            # A view further into the same buffer: the room after it is kept.
            self._k, self._v = self._k[:, :, columns:], self._v[:, :, columns:]
            self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self._k is None:
                self.assign(key_states, value_states, _ROOM)
                return self.keys, self.values
            n, w = self.keys.shape[-2], key_states.shape[-2]
            if n + w > self._k.shape[-2]:
                self.assign(self.keys, self.values, max(w, n // 2, _ROOM))
            self._k[:, :, n : n + w], self._v[:, :, n : n + w] = key_states, value_states
            self.keys, self.values = self._k[:, :, : n + w], self._v[:, :, : n + w]
            return self.keys, self.values

        # transformers' own surgery replaces `keys` without the buffer behind
        # it; colonnade never calls it, and a later update would then write
        # into a stale buffer: refuse rather than go wrong.
        is_croppable = False

        def crop(self, max_length: int) -> None:
            raise NotImplementedError("GrowingLayer: crop is not supported")

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise NotImplementedError("GrowingLayer: batch_repeat_interleave is not supported")

        def reorder_cache(self, beam_idx: torch.Tensor) -> None:
            raise NotImplementedError("GrowingLayer: reorder_cache is not supported")

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self.get_seq_length() > 0:
                n = self.keys.shape[-2]
                self._k, self._v = self._k[indices], self._v[indices]
                self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

    return GrowingLayer


# Spare columns a cache layer keeps beyond what it holds (grown by half as it fills).
_ROOM = 128


class _TorchSession:
    def __init__(self, engine: Engine, batch: int):
        from transformers import DynamicCache

        # No config: every layer a full layer, sliding ones too, so the cache
        # keeps every column and can be cut, padded and joined by column like
        # the layout; windows are applied in the mask (`_mask`).
        self.engine, self.cache = engine, DynamicCache()
        self.cache.layer_class_to_replicate = _growing_layer()
        self.layout = Layout(batch, engine.device)
        self.windows = layer_windows(engine.model.config)

    def step(self, chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        index = self.layout.compact()
        if index is not None:
            for layer in self.cache.layers:
                layer.gather(index)
        ids, positions, mask = self.layout.block(chunks, self.engine.pad_id)
        out = self.engine.model(
            input_ids=ids,
            attention_mask=self._mask(mask),
            position_ids=positions,
            **{self.engine.cache_arg: self.cache},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _mask(self, allowed: torch.Tensor | None):
        """The block mask as the model takes it: one tensor, or one per layer type.

        None (no pad column yet) leaves the masks to transformers, whose
        column positions are then real-token positions.
        """
        if allowed is None or not any(self.windows.values()):
            return allowed
        masks = {
            kind: allowed if window is None else self.layout.windowed(allowed, window)
            for kind, window in self.windows.items()
        }
        return masks.get(None, masks)

    def keep(self, rows: list[int]) -> None:
        self.cache.batch_select_indices(self.layout.keep(rows))
        drop = self.layout.trim()
        if drop:
            for layer in self.cache.layers:
                layer.drop_front(drop)

    def take(self, rows: list[int]) -> _TorchSession:
        out = self.engine._session(len(rows))
        out.layout = self.layout.take(rows)
        index = torch.tensor(rows, dtype=torch.long, device=self.engine.device)
        for layer in self.cache.layers:
            copy = _growing_layer()()
            keys, values = layer.keys[index], layer.values[index]
            copy.lazy_initialization(keys, values)
            copy.assign(keys, values, _ROOM)
            out.cache.layers.append(copy)
        drop = out.layout.trim()
        if drop:
            for layer in out.cache.layers:
                layer.drop_front(drop)
        return out

    def place(self, slots: list[int], other: _TorchSession) -> bool:
        width, theirs = self.layout.real.shape[1], other.layout.real.shape[1]
        if theirs > width:
            return False
        self.layout.place(slots, other.layout)
        index = torch.tensor(slots, dtype=torch.long, device=self.engine.device)
        if not theirs:  # rows that have not run yet (no prefill): nothing cached
            return True
        # The ended rows' older columns stay in the buffer, masked out of every query.
        for mine, new in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys[index, :, width - theirs :] = new.keys
            mine.values[index, :, width - theirs :] = new.values
        return True

    def feed(self, rows: list[int], chunks: Sequence[Sequence[int]]) -> None:
        """`Feeding`: the rows' chunks run on a copy of those rows alone, and
        the columns they make are appended to every row, real for these rows
        and pad for the rest (the compaction drops them when they pile up)."""
        part = self.take(rows)
        part.step(chunks)
        width = max(len(c) for c in chunks)
        self.layout.append(rows, part.layout, width)
        index = torch.tensor(rows, dtype=torch.long, device=self.engine.device)
        batch = self.layout.real.shape[0]
        for mine, theirs in zip(self.cache.layers, part.cache.layers, strict=True):
            keys, values = theirs.keys[:, :, -width:], theirs.values[:, :, -width:]
            new_k = keys.new_zeros((batch, *keys.shape[1:]))
            new_v = values.new_zeros((batch, *values.shape[1:]))
            new_k[index], new_v[index] = keys, values
            mine.update(new_k, new_v)

    def extend(self, other: _TorchSession) -> None:
        pad_a, pad_b = self.layout.extend(other.layout)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.assign(
                torch.cat([_left_pad(mine.keys, pad_a), _left_pad(theirs.keys, pad_b)]),
                torch.cat([_left_pad(mine.values, pad_a), _left_pad(theirs.values, pad_b)]),
                _ROOM,
            )


def layer_windows(config) -> dict[str | None, int | None]:
    """{layer type: its attention window, None for full attention}, as the
    model takes its masks: keyed by `config.layer_types` (Gemma 3, Qwen2/3:
    a dict of masks), or the single key None (Llama, Mistral, Phi-3: one
    mask, windowed everywhere when `sliding_window` is set).
    """
    text = config.get_text_config()
    window = getattr(text, "sliding_window", None)
    kinds = getattr(text, "layer_types", None)
    if kinds is None:
        return {None: window}
    unknown = set(kinds) - {"full_attention", "sliding_attention"}
    if unknown:
        raise ValueError(f"the torch engine runs full and sliding attention, not {sorted(unknown)}")
    return {kind: window if kind == "sliding_attention" else None for kind in kinds}


def _left_pad(t: torch.Tensor, columns: int) -> torch.Tensor:
    """[B, H, T, D] with `columns` zero columns before T (masked out of every query)."""
    return torch.nn.functional.pad(t, (0, 0, columns, 0)) if columns else t


def units(prompts: Sequence[Sequence[int]], max_rows: int) -> list[list[int]]:
    """Row indices in admission units: runs of one prompt (a group), at most `max_rows` each."""
    out: list[list[int]] = []
    for i, p in enumerate(prompts):
        unit = out[-1] if out else None
        if unit and prompts[unit[0]] == p and (not max_rows or len(unit) < max_rows):
            unit.append(i)
        else:
            out.append([i])
    return out


class Engine:
    """Runs a causal LM (float or int8) over batches of multi-turn episodes.

    The episode loop (sampling, stops, turns, the environment) lives here;
    the forward pass and its cache are a `Session` from `_session`, so the
    MLX engine (`mlx_engine.MlxEngine`) differs from this one only there.
    """

    name = "torch"

    def __init__(self, model, tokenizer, version: int = 0):
        self._bind(model, tokenizer, version)
        self.device = next(model.parameters()).device
        # transformers 5.x renamed `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"

    def _bind(self, model, tokenizer, version: int) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.version = version
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        self.eos_ids = {tokenizer.eos_token_id} - {None}

    def _session(self, batch: int) -> Session:
        return _TorchSession(self, batch)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        responders: Sequence[Responder],
        params: SamplingParams,
        seed: int = 0,
        max_rows: int = 0,
        share_prefix: bool = True,
        split_replies: bool = True,
    ) -> list[Episode]:
        """One episode per prompt; `responders[i]` answers episode i's turns.

        With `share_prefix`, the rows of one prompt (a group) are prefilled
        once and the cache copied to each. With `split_replies`, a tool reply
        is fed to its own row before the step (where the session can), not
        padded into a step that runs every other row as wide. With
        `max_rows`, at most that many episodes run at once and, as episodes
        end, waiting rows take the free places in the running batch, in
        order, a group's rows admitted together sharing one prefill
        (continuous batching), instead of the batch shrinking to its slowest
        row. Both need prompts of 2 tokens or more (the last token is fed
        with the running batch); otherwise all rows run at once.
        """
        if len(prompts) != len(responders):
            raise ValueError("one responder per prompt")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("empty prompt")
        if max_rows < 0:
            raise ValueError("max_rows must be >= 0")
        gen = torch.Generator().manual_seed(seed)
        stops = StopMatcher(self.tokenizer, params.stop)
        rows = [
            _Row(Episode(list(p), self.version), r, list(p))
            for p, r in zip(prompts, responders, strict=True)
        ]
        share = share_prefix and all(len(p) >= 2 for p in prompts)
        waiting = deque(units(prompts, max_rows) if share else [list(range(len(rows)))])
        # The session's rows; None where an episode ended and no row has
        # taken its place yet (dropped before the next step).
        live: list[_Row | None] = []
        session: Session | None = None
        prefixes: dict[tuple[int, ...], Session] = {}  # prompts of groups still waiting
        while waiting or live:
            # Fill the free rows from the waiting units, in order (a unit
            # may start in part: its rows still share one prefill), all
            # admitted rows prefilled together.
            free = [i for i, r in enumerate(live) if r is None]
            admit = _admitted(waiting, rows, len(live) - len(free), max_rows)
            if admit:
                part = self._prefilled(admit, prefixes) if share else self._session(len(admit))
                if share:
                    wanted = {tuple(rows[u[0]].pending) for u in waiting}
                    prefixes = {p: s for p, s in prefixes.items() if p in wanted}
                if session is None:
                    session, live = part, list(admit)
                elif (
                    len(admit) <= len(free)
                    and isinstance(session, Reusing)
                    and session.place(free[: len(admit)], part)
                ):
                    # Ended rows' places taken in place: no copy of the cache.
                    for slot, row in zip(free, admit, strict=False):
                        live[slot] = row
                else:
                    self._drop_ended(session, live)
                    session.extend(part)
                    live.extend(admit)
            if None in live:
                self._drop_ended(session, live)
            if split_replies:
                _split_replies(session, live)
            tokens, logprobs = sample(session.step([r.pending for r in live]), params, gen)
            for i, row in enumerate(live):
                if not self._advance(row, int(tokens[i]), float(logprobs[i]), params, stops):
                    live[i] = None
            if all(r is None for r in live):
                live, session = [], None
        return [r.episode for r in rows]

    @staticmethod
    def _drop_ended(session: Session, live: list[_Row | None]) -> None:
        going = [i for i, r in enumerate(live) if r is not None]
        if len(going) < len(live):
            session.keep(going)
            live[:] = [live[i] for i in going]

    def _prefilled(self, unit: list[_Row], prefixes: dict[tuple[int, ...], Session]) -> Session:
        """A session holding each row's prompt but its last token, one prefill per
        distinct prompt; each row's pending chunk becomes that last token.

        A group admitted in parts (rows free up one by one) is prefilled once:
        a prompt's prefilled row is kept in `prefixes`, and later parts copy it.
        """
        distinct: dict[tuple[int, ...], int] = {}
        index = [distinct.setdefault(tuple(r.pending), len(distinct)) for r in unit]
        for r in unit:
            r.pending = r.pending[-1:]
        missing = [p for p in distinct if p not in prefixes]
        if missing:
            made = self._session(len(missing))
            made.step([list(p[:-1]) for p in missing])
            if not isinstance(made, Reusing):  # a backend without row copies: no reuse
                made.keep(index)
                return made
            for j, p in enumerate(missing):
                prefixes[p] = made.take([j])
        bank = [prefixes[p] for p in distinct]
        if len(bank) == 1:
            return bank[0].take(index)
        joined = bank[0].take([0])
        for other in bank[1:]:
            joined.extend(other)
        return joined.take(index)

    def _advance(self, row: _Row, token: int, logprob: float, params, stops) -> bool:
        """Record a sampled token; False when the episode is over."""
        ep = row.episode
        ep.add([token], True, [logprob])
        row.turn.append(token)
        if token in self.eos_ids and not params.ignore_eos:
            ep.turns.append(self.tokenizer.decode(row.turn, skip_special_tokens=True))
            ep.finish = "eos"
            return False
        turn_over = stops.hit(row.turn) or len(row.turn) >= params.max_turn_tokens
        if not turn_over:
            if len(ep.tokens) >= params.max_episode_tokens:
                ep.turns.append(self.tokenizer.decode(row.turn, skip_special_tokens=True))
                ep.finish = "length"
                return False
            row.pending = [token]
            return True
        text = stops.cut(self.tokenizer.decode(row.turn, skip_special_tokens=True))
        ep.turns.append(text)
        reply = row.respond(text)
        if reply is None:
            ep.finish = "done"
            return False
        env_ids = self.tokenizer.encode(reply, add_special_tokens=False)
        if len(ep.tokens) + len(env_ids) >= params.max_episode_tokens:
            ep.finish = "length"
            return False
        ep.add(env_ids, False)
        row.pending, row.turn = [token, *env_ids], []
        return True
