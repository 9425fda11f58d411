"""The torch backend: a transformers causal LM (float, or colonnade's int8 linears).

The model is any transformers causal LM; on CPU its linears are
`model.int8.Int8Linear`s holding the published codes (the loader puts them
in), on CUDA/MPS the codes run dequantized. The cache is transformers'
`DynamicCache` built only of full-attention layers (sliding ones too), so
every layer keeps every column and can be cut by column like the layout;
windows are applied in the mask.

A state with LoRA adapters runs them unmerged, a hook on each adapted
linear (`model.unmerged`); a refresh that changes only adapters copies
them in place.

On CPU the step can run compiled (`compile`: off, on, or auto where it
measures faster on the machine; `torch_compile.py`), falling back to the
eager step where the compiler fails.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping, Set

import numpy as np
import torch

from .layout import Block, Layout
from .torch_compile import mode_from, prepared_step

# Spare columns a cache layer keeps beyond what it holds (grown by half as it fills).
ROOM = 128


@functools.cache
def growing_layer():
    """A full-attention cache layer whose columns live in a buffer with room
    to spare: a step writes its new columns in place, where transformers'
    `DynamicLayer` concatenates and so copies the whole cache every step.

    `keys`/`values` are views of the first `length` columns; cuts go through
    `assign` or `drop_front`. Built lazily: transformers is imported only here.
    """
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        def lazy_initialization(self, key_states, value_states) -> None:
            super().lazy_initialization(key_states, value_states)
            self._k = self._v = None

        def assign(self, keys: torch.Tensor, values: torch.Tensor, room: int = 0) -> None:
            """Hold these columns, with space for `room` more before copying again."""
            if not self.is_initialized:
                self.lazy_initialization(keys, values)
            b, h, t, d = keys.shape
            self._k = keys.new_empty((b, h, t + room, d))
            self._v = values.new_empty((b, values.shape[1], t + room, values.shape[-1]))
            self._k[:, :, :t], self._v[:, :, :t] = keys, values
            self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]

        def stack(self, others: list, pads: list[int], room: int) -> None:
            """This layer's rows, then each of `others`', each left-padded
            with `pads` zero columns (this layer's first) to one width, into
            one new buffer with `room` to spare: made once, where padding,
            concatenating then `assign` would copy the whole cache three
            times over, and joining in pairs once a level."""
            parts = [self, *others]
            t = self.keys.shape[2] + pads[0]
            if len(pads) != len(parts) or any(
                p.keys.shape[2] + pad != t for p, pad in zip(parts, pads, strict=True)
            ):
                raise ValueError("stacked caches must come to one width")
            self._k = _stacked([p.keys for p in parts], pads, t + room)
            self._v = _stacked([p.values for p in parts], pads, t + room)
            self.keys, self.values = self._k[:, :, :t], self._v[:, :, :t]

        def gather(self, index: torch.Tensor) -> None:
            """Keep, for each row b, columns index[b]."""
            at = index[:, None, :, None]
            keys, values = self.keys, self.values
            self.assign(
                keys.gather(2, at.expand(-1, keys.shape[1], -1, keys.shape[3])),
                values.gather(2, at.expand(-1, values.shape[1], -1, values.shape[3])),
                ROOM,
            )

        def drop_front(self, columns: int) -> None:
            # A view further into the same buffer: the room after it is kept.
            self._k, self._v = self._k[:, :, columns:], self._v[:, :, columns:]
            self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self._k is None:
                self.assign(key_states, value_states, ROOM)
                return self.keys, self.values
            n, w = self.keys.shape[-2], key_states.shape[-2]
            if n + w > self._k.shape[-2]:
                self.assign(self.keys, self.values, max(w, n // 2, ROOM))
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


def _stacked(parts: list[torch.Tensor], pads: list[int], width: int) -> torch.Tensor:
    """[sum of B, H, width, D]: each part's rows in turn, each after its zero
    pad columns (masked out of every query), the columns past them unset."""
    first = parts[0]
    t = first.shape[2] + pads[0]
    out = first.new_empty((sum(p.shape[0] for p in parts), first.shape[1], width, first.shape[3]))
    row = 0
    for part, pad in zip(parts, pads, strict=True):
        end = row + part.shape[0]
        out[row:end, :, :pad] = 0
        out[row:end, :, pad:t] = part
        row = end
    return out


class TorchCache:
    """`backend.Cache` over a transformers `DynamicCache` of growing layers."""

    def __init__(self, device: torch.device):
        from transformers import DynamicCache

        self.device = device
        self.dynamic = DynamicCache()
        self.dynamic.layer_class_to_replicate = growing_layer()

    @property
    def layers(self) -> list:
        return self.dynamic.layers

    @property
    def empty(self) -> bool:
        return not self.layers

    def _index(self, index: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(index).to(self.device)

    def rows(self, index: np.ndarray, drop: int) -> TorchCache:
        out, at = TorchCache(self.device), self._index(index)
        for layer in self.layers:
            copy = growing_layer()()
            copy.assign(layer.keys[at, :, drop:], layer.values[at, :, drop:], ROOM)
            out.layers.append(copy)
        return out

    def select(self, index: np.ndarray, drop: int) -> None:
        at = self._index(index)
        for layer in self.layers:
            layer.batch_select_indices(at)
            if drop:
                layer.drop_front(drop)

    def write(self, slots: np.ndarray, other: TorchCache, start: int) -> None:
        at = self._index(slots)
        for mine, new in zip(self.layers, other.layers, strict=True):
            end = start + new.keys.shape[2]
            mine.keys[at, :, start:end] = new.keys
            mine.values[at, :, start:end] = new.values

    def append(self, rows: np.ndarray, other: TorchCache, width: int) -> None:
        at = self._index(rows)
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            keys, values = theirs.keys[:, :, -width:], theirs.values[:, :, -width:]
            batch = mine.keys.shape[0]
            new_k = keys.new_zeros((batch, *keys.shape[1:]))
            new_v = values.new_zeros((batch, *values.shape[1:]))
            new_k[at], new_v[at] = keys, values
            mine.update(new_k, new_v)

    def join(self, other: TorchCache, pad_self: int, pad_other: int) -> None:
        self.stack([other], [pad_self, pad_other])

    def stack(self, others: list[TorchCache], pads: list[int]) -> None:
        """Every one of `others`' rows after these, all in one buffer, each
        padded before by its `pads` columns (these rows' first)."""
        if any(len(o.layers) != len(self.layers) for o in others):
            raise ValueError("stacked caches must have the same layers")
        for i, mine in enumerate(self.layers):
            mine.stack([o.layers[i] for o in others], pads, ROOM)

    def gather(self, index: np.ndarray) -> None:
        at = self._index(index)
        for layer in self.layers:
            layer.gather(at)


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


class TorchBackend:
    """`backend.Backend` over a transformers causal LM already holding its weights.

    `compile` (off, on, auto; None: `COLONNADE_COMPILE`, else off): whether
    steps on CPU run compiled (`torch_compile.py`), decided at the first
    step or by `prepare`.
    """

    name = "torch"

    def __init__(
        self,
        model,
        precision: str = "fp32",
        aliases: Mapping[str, str] | None = None,
        compile: str | None = None,
    ):
        self.model = model
        self.precision = precision
        # Tied names, taken before the model was ever loaded with int8 linears
        # (a swapped model no longer shows its ties); `refresh` needs them.
        self.aliases = dict(aliases or {})
        self.device = next(model.parameters()).device
        self.windows = layer_windows(model.config)
        # transformers 5.x renamed `past_key_values` to `cache`.
        params = inspect.signature(model.forward).parameters
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        mode = mode_from(compile)
        self.compile = mode if self.device.type == "cpu" else "off"
        self._step = None  # the CompiledStep steps run through, once prepared
        self._prepared = self.compile == "off"

    def new_cache(self, batch: int) -> TorchCache:
        return TorchCache(self.device)

    def prepare(self) -> bool:
        """Compile now (compile on, or auto where compiled measures faster)
        rather than at the first step; whether steps run compiled."""
        if not self._prepared:
            self._step, self._prepared = prepared_step(self), True
        return self._step is not None

    @property
    def compiled(self) -> bool:
        """Whether steps run compiled (False until prepared)."""
        return self._step is not None

    def forward(self, cache: TorchCache, block: Block, layout: Layout) -> torch.Tensor:
        if self.prepare():
            logits = self._step.forward(cache, block, layout)
            if logits is not None:
                return logits
            self._step = None  # the compiler failed (logged): eagerly from now on
        return self.eager_forward(cache, block, layout)

    def eager_forward(self, cache: TorchCache, block: Block, layout: Layout) -> torch.Tensor:
        """A step through transformers' eager forward."""
        out = self.model(
            input_ids=torch.from_numpy(block.ids).to(self.device),
            attention_mask=self._mask(block.allowed, layout),
            position_ids=torch.from_numpy(block.positions).to(self.device),
            **{self.cache_arg: cache.dynamic},
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1, :]

    def _mask(self, allowed: np.ndarray | None, layout: Layout):
        """The block mask as the model takes it: one tensor, or one per layer type.

        None (no pad column yet) leaves the masks to transformers, whose
        column positions are then real-token positions.
        """
        if allowed is None:
            return None
        full = torch.from_numpy(allowed).to(self.device)
        if not any(self.windows.values()):
            return full
        masks = {
            kind: full
            if w is None
            else torch.from_numpy(layout.windowed(allowed, w)).to(self.device)
            for kind, w in self.windows.items()
        }
        return masks.get(None, masks)

    def refresh(self, state, changed: Set[str] | None) -> None:
        from .loader import load_torch

        if load_torch(self.model, state, self.aliases, self.precision, self.device, changed):
            # Adapters came, went or changed rank: a graph traced before has
            # their hooks (or lacks them) built in, so the next step traces again.
            self._step, self._prepared = None, self.compile == "off"
