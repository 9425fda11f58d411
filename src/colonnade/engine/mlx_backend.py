"""The MLX backend: mlx-lm's models running the published int8 codes.

What this module owns: building an mlx-lm model (`mlx_lm.models.<arch>.Model`)
from the run's transformers config (`MlxModel`), putting a published state
into it (int8 codes into `nn.QuantizedLinear`, everything else as floats; a
PULSE patch rebuilds only the tensors it changed), and its batched KV cache
(`MlxCache`). The episode loop is the engine's own (`loop.Engine`), so both
backends write the same records.

The int8 layout: MLX stores w = scale · q + bias with q an unsigned byte, one
(scale, bias) per group of 32/64/128 columns. A published row (codes c,
scale s) becomes q = c + 128, every group's scale s and bias −128 · s. MLX
evaluates scale · q and then + bias as two float32 roundings; because the
quantizer keeps 16 significant bits in s (`pulse.quant.round_scale_up`),
both are exact and the dequantized weight is c · s bit for bit, the value
the torch engine multiplies by. A row no group size divides runs as a float
linear of the same dequantized values.

Mixture-of-experts: a transformers MoE keeps its experts as 3-D tensors
([E, out, in]); the publisher quantizes 2-D weights only (`pulse.quant`), so
experts are published in bf16 and both engines run those bf16 values (torch:
float32 copies, `model.int8`; here mlx-lm's `SwitchLinear` in float32). The
router is an ordinary 2-D weight and runs int8.

LoRA: a state with adapters (`model/lora.py`, the scale folded into B) runs
each adapted linear as mlx-lm's `LoRALinear` around its base, with scale 1:
unmerged, so a patch of the adapters alone rebuilds only them.

The cache: mlx-lm's own caches hold one sequence, or a batch that is only
ever left-padded (`BatchKVCache`). `MlxCache` keeps `BatchKVCache`'s
preallocated storage per layer and takes its mask and per-row RoPE offsets
from the session's `Layout` (see `layout.py` for why pads sit anywhere).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from colonnade.choices import RUN_PRECISIONS
from colonnade.model.int8 import float_value, lookup
from colonnade.model.lora import adapted
from colonnade.pulse.quant import SCALE_SUFFIX

from .backend import BackendUnavailable, UnsupportedArchitecture

# model_type (transformers) -> mlx-lm module, for the architectures whose
# tensor names, rotary settings and masks are checked against the torch
# engine (tests/rollout/test_mlx_archs.py). mistral is llama in mlx-lm.
ARCHITECTURES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3_text",
    "phi3": "phi3",
    "qwen3_moe": "qwen3_moe",
}
GROUP_SIZES = (128, 64, 32)
ADAPTER = "#adapter"  # a linear's name + this: its adapter's sources


class MlxUnavailable(BackendUnavailable):
    """MLX (or mlx-lm) is not installed, or not importable, on this machine."""


def mlx_missing() -> str | None:
    """Why the MLX engine cannot run here, in one line; None when it can."""
    try:
        import mlx.core  # noqa: F401
        import mlx_lm  # noqa: F401
    except ImportError as e:
        return (
            f"the MLX engine needs the mlx and mlx-lm packages ({e}); install them with "
            "`pip install 'colonnade[mlx]'` (Apple silicon, or mlx[cpu] on Linux x86_64)"
        )
    return None


@functools.cache  # once per process: every step goes through it
def _mlx():
    reason = mlx_missing()
    if reason:
        raise MlxUnavailable(reason)
    import mlx.core as mx
    import mlx.nn as nn

    return mx, nn


def group_size_for(in_features: int) -> int | None:
    return next((g for g in GROUP_SIZES if in_features % g == 0), None)


def int8_layout(codes: torch.Tensor, scale: torch.Tensor):
    """(packed uint32 [O, I/4], scales [O, I/g], biases [O, I/g], g) of one int8 weight.

    None when no MLX group size divides the row (the caller runs it dequantized).
    """
    if sys.byteorder != "little":  # MLX packs the first byte lowest
        raise MlxUnavailable("the MLX int8 layout is built for little-endian machines")
    in_features = codes.shape[1]
    group = group_size_for(in_features)
    if group is None:
        return None
    q = (codes.numpy().astype(np.int16) + 128).astype(np.uint8)
    scales = np.repeat(scale.numpy().astype(np.float32)[:, None], in_features // group, axis=1)
    return np.ascontiguousarray(q).view(np.uint32), scales, -128.0 * scales, group


def quantized_linear(layout, bias):
    """An mlx `nn.QuantizedLinear` (8 bits, affine) holding exactly `layout`."""
    mx, nn = _mlx()
    packed, scales, biases, group = layout
    out_features, in_features = packed.shape[0], packed.shape[1] * 4
    # The constructor's random weight is lazy and replaced before it is ever
    # evaluated: building the layer costs nothing.
    layer = nn.QuantizedLinear(in_features, out_features, bias is not None, group, 8)
    layer.weight, layer.scales, layer.biases = mx.array(packed), mx.array(scales), mx.array(biases)
    if bias is not None:
        layer.bias = bias
    return layer


def dense_linear(weight, bias):
    _, nn = _mlx()
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias is not None)
    layer.weight = weight
    if bias is not None:
        layer.bias = bias
    return layer


def dequantized(layer) -> np.ndarray:
    """The float32 weight a linear multiplies by (quantized or not)."""
    mx, nn = _mlx()
    if isinstance(layer, nn.QuantizedLinear):
        w = mx.dequantize(
            layer.weight, layer.scales, layer.biases, group_size=layer.group_size, bits=8
        )
        return np.array(w)
    return np.array(layer.weight.astype(mx.float32))


def mlx_module(model_type: str) -> str:
    """The mlx-lm module for `model_type`; UnsupportedArchitecture in one line if none."""
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"the mlx engine does not run {model_type!r} models (it runs "
            f"{', '.join(ARCHITECTURES)}); use --engine torch"
        )
    return ARCHITECTURES[model_type]


def mlx_args(config) -> dict:
    """mlx-lm's ModelArgs fields from a transformers config.

    transformers 5 keeps rotary settings in `rope_parameters` (per layer type
    for Gemma 3), Gemma 3's layer pattern in `layer_types` and some fields
    under other names (`attribute_map`); mlx-lm reads the older flat fields,
    and silently takes its defaults for missing ones.
    """
    d = config.to_dict()
    d["model_type"] = config.model_type
    for alias, field in getattr(config, "attribute_map", {}).items():
        if field in d:  # e.g. Qwen3-MoE's num_experts is stored as num_local_experts
            d.setdefault(alias, d[field])
    rope = d.get("rope_parameters") or {}
    if config.model_type == "gemma3_text":
        local = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention") or {}
        if "rope_theta" in local:
            d["rope_local_base_freq"] = local["rope_theta"]
        d["sliding_window_pattern"] = _gemma_pattern(d.get("layer_types"))
    if "rope_theta" in rope:
        d["rope_theta"] = rope["rope_theta"]
    if "partial_rotary_factor" in rope:
        d["partial_rotary_factor"] = rope["partial_rotary_factor"]
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        d["rope_scaling"] = {**rope, "type": kind, "rope_type": kind}
    return d


def _gemma_pattern(layer_types: Sequence[str] | None) -> int:
    """Gemma 3's sliding_window_pattern (every n-th layer global) from its layer types."""
    if not layer_types:
        return 6  # transformers' and mlx-lm's default
    n = next((i + 1 for i, t in enumerate(layer_types) if t == "full_attention"), None)
    expected = [
        "full_attention" if n and i % n == n - 1 else "sliding_attention"
        for i in range(len(layer_types))
    ]
    if n is None or list(layer_types) != expected:
        raise UnsupportedArchitecture(
            f"the mlx engine runs Gemma 3 with every n-th layer global, not {list(layer_types)}"
        )
    return n


def build_mlx_model(config):
    """An mlx-lm model of `config`'s architecture (weights not loaded yet)."""
    import importlib

    _mlx()
    module = importlib.import_module(f"mlx_lm.models.{mlx_module(config.model_type)}")
    net = module.Model(module.ModelArgs.from_dict(mlx_args(config)))
    if getattr(config, "tie_word_embeddings", False) and "lm_head" in net:
        # What mlx-lm's `sanitize` does when a checkpoint has no lm_head.
        net.pop("lm_head")
        if hasattr(net, "tie_word_embeddings"):
            net.tie_word_embeddings = True
    return net


def _owner(net, path: str):
    """(module holding the attribute, attribute name) for a dotted parameter path."""
    *parents, leaf = path.split(".")
    node = net
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node, leaf


def _experts(config) -> dict[str, tuple[str, Callable[[torch.Tensor], torch.Tensor]]]:
    """{mlx-lm name: (transformers state name, how to cut it)} for fused MoE experts."""
    if config.model_type != "qwen3_moe":
        return {}
    inner = config.moe_intermediate_size
    out = {}
    for i in range(config.num_hidden_layers):
        src, dst = f"model.layers.{i}.mlp.experts.", f"model.layers.{i}.mlp.switch_mlp."
        # transformers fuses [gate; up] along the output rows: [E, 2I, H].
        out[dst + "gate_proj.weight"] = (src + "gate_up_proj", lambda t: t[:, :inner])
        out[dst + "up_proj.weight"] = (src + "gate_up_proj", lambda t: t[:, inner:])
        out[dst + "down_proj.weight"] = (src + "down_proj", lambda t: t)
    return out


class MlxModel:
    """An mlx-lm model running a published state; weights come from the state by name."""

    def __init__(self, config, aliases: Mapping[str, str], precision: str):
        if precision not in RUN_PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {RUN_PRECISIONS}")
        mx, nn = _mlx()
        self.config, self.aliases, self.precision = config, dict(aliases), precision
        self.dtype = mx.bfloat16 if precision == "bf16" else mx.float32
        self.net = build_mlx_model(config)
        self.linear_names = [
            n for n, m in self.net.named_modules() if isinstance(m, nn.Linear | nn.QuantizedLinear)
        ]
        owned = {f"{n}.{p}" for n in self.linear_names for p in ("weight", "bias")}
        from mlx.utils import tree_flatten

        self.tensor_names = [n for n, _ in tree_flatten(self.net.parameters()) if n not in owned]
        self.experts = _experts(config)
        # name -> the torch tensors it was built from, held so that `is` is a
        # sound test (an id could be reused once a tensor is freed).
        self._sources: dict[str, tuple] = {}
        self.loaded = False

    @property
    def layers(self) -> int:
        return len(self.net.layers)

    def load(self, state: Mapping[str, torch.Tensor]) -> int:
        """Take a version's state (int8 codes + scales, or float, and LoRA
        adapters); how many linears, adapters and tensors were rebuilt.

        A PULSE patch leaves unchanged tensors as the same objects, so after
        a patch only the changed ones are laid out again, in place: a patch
        of adapters alone rebuilds the adapters, never the base.
        """
        pairs = adapted(state)
        unknown = set(pairs) - set(self.linear_names)
        if unknown:
            raise UnsupportedArchitecture(
                f"the mlx engine has no linear {min(unknown)} for the state's adapter"
            )
        rebuilt = 0
        for name in self.linear_names:
            key = lookup(state, f"{name}.weight", self.aliases)
            bias_t = state.get(f"{name}.bias")
            source = (state[key], state.get(key + SCALE_SUFFIX), bias_t)
            if not _same(self._sources.get(name), source):
                self._place(name, self._linear(state, key, bias_t))
                self._sources[name], rebuilt = source, rebuilt + 1
            rebuilt += self._load_adapter(name, state, pairs.get(name))
        for name in self.tensor_names:
            key, cut = self.experts.get(name, (name, None))
            key = lookup(state, key, self.aliases)
            source = (state[key], state.get(key + SCALE_SUFFIX))
            if not _same(self._sources.get(name), source):
                value = float_value(state, key, {})
                owner, attr = _owner(self.net, name)
                owner[attr] = self._array(value if cut is None else cut(value))
                self._sources[name], rebuilt = source, rebuilt + 1
        self.loaded = True
        return rebuilt

    def _place(self, name: str, layer) -> None:
        """`layer` as linear `name`'s base (inside its adapter, where it has one)."""
        owner, attr = _owner(self.net, name)
        if isinstance(owner[attr], _lora_class()):
            owner[attr].linear = layer
        else:
            owner[attr] = layer

    def _load_adapter(self, name: str, state, pair: tuple[str, str] | None) -> int:
        """Linear `name`'s adapter from `state` (`pair`: its A and B keys, None
        for none): 1 where it was laid out again, else 0."""
        owner, attr = _owner(self.net, name)
        held = owner[attr] if isinstance(owner[attr], _lora_class()) else None
        if pair is None:
            if held is None:
                return 0
            owner[attr] = held.linear  # the base alone again
            del self._sources[name + ADAPTER]
            return 1
        source = (state[pair[0]], state[pair[1]])
        if _same(self._sources.get(name + ADAPTER), source):
            return 0
        if held is None:
            held = owner[attr] = unmerged(owner[attr], source[0].shape[0])
        # mlx-lm's layout: lora_a [in, r], lora_b [r, out]; in float32 as the
        # torch engine computes them, the scale already in B'.
        mx, _ = _mlx()
        held.lora_a = mx.array(source[0].detach().float().T.contiguous().numpy())
        held.lora_b = mx.array(source[1].detach().float().T.contiguous().numpy())
        self._sources[name + ADAPTER] = source
        return 1

    def _array(self, t: torch.Tensor):
        mx, _ = _mlx()
        return mx.array(t.detach().float().contiguous().numpy()).astype(self.dtype)

    def _linear(self, state, key: str, bias_t):
        bias = None if bias_t is None else self._array(bias_t)
        scale = state.get(key + SCALE_SUFFIX)
        if self.precision == "int8" and scale is not None:
            layout = int8_layout(state[key], scale)
            if layout is not None:
                return quantized_linear(layout, bias)
        return dense_linear(self._array(float_value(state, key, {})), bias)

    def linear(self, name: str):
        """Linear `name`'s base layer (without its adapter, where it has one)."""
        owner, attr = _owner(self.net, name)
        layer = owner[attr]
        return layer.linear if isinstance(layer, _lora_class()) else layer

    def last_logits(self, ids, cache):
        """Logits [B, V] of each row's last column: mlx-lm's forward, the head on
        one column only (each supported Model.__call__ is body + lm_head or the
        tied embedding)."""
        if not self.loaded:
            raise RuntimeError("no weights loaded: call load(state) first")
        h = self.net.model(ids, cache)[:, -1:, :]
        head = self.net.lm_head if "lm_head" in self.net else self.net.model.embed_tokens.as_linear
        return head(h)[:, 0, :]

    def sequence_logprobs(self, ids: list[int], start: int, temperature: float = 1.0):
        """Log-probs (torch, float32) of ids[start:] given their prefixes: one
        teacher-forced pass through mlx-lm's own forward and mask."""
        from colonnade.model.logprobs import gather_logprobs

        mx, _ = _mlx()
        if not 0 < start < len(ids):
            raise ValueError("start must leave a prefix and at least one scored token")
        logits = self.net(mx.array([ids]))[0, start - 1 : -1].astype(mx.float32)
        return gather_logprobs(
            torch.from_numpy(np.array(logits)), torch.tensor(ids[start:]), temperature
        )


@functools.cache
def _lora_class():
    from mlx_lm.tuner.lora import LoRALinear

    return LoRALinear


def unmerged(layer, rank: int):
    """mlx-lm's `LoRALinear` around `layer` with scale 1 (the published B'
    holds the scale) and no dropout: base(x) + (x · A) · B. Its adapters are
    set by the caller."""
    return _lora_class().from_base(layer, r=rank, dropout=0.0, scale=1.0)


def _same(old: tuple | None, new: tuple) -> bool:
    return old is not None and all(a is b for a, b in zip(old, new, strict=True))


@functools.cache
def _layer_cache_class():
    """`_LayerCache`, defined once mlx-lm is importable."""
    from mlx_lm.models.cache import BatchKVCache

    class _LayerCache(BatchKVCache):
        """mlx-lm's preallocated batch cache; mask and RoPE offsets from the backend."""

        def __init__(self, owner: MlxCache):
            super().__init__([0] * owner.batch)
            self.owner = owner

        def make_mask(self, N: int, return_array: bool = False, window_size=None, **_):
            return self.owner.mask(window_size, return_array)

        def hold(self, keys, values) -> None:
            """These arrays as the whole cache (mlx-lm grows them from here)."""
            self.keys, self.values, self._idx = keys, values, keys.shape[2]

    return _LayerCache


class MlxCache:
    """`backend.Cache` over one mlx-lm batch cache per layer.

    mlx-lm's caches hold one sequence, or a batch that is only ever
    left-padded; here the mask and per-row RoPE offsets come from the
    session's `Layout` (set by `MlxBackend.forward` for each step)."""

    def __init__(self, layers: int, batch: int):
        self.mx, _ = _mlx()
        self.batch = batch
        cls = _layer_cache_class()
        self.layers = [cls(self) for _ in range(layers)]
        self._masks: dict = {}
        self._block = None  # this step's Block
        self._layout = None

    @property
    def empty(self) -> bool:
        return self.layers[0].keys is None

    def _new(self, batch: int) -> MlxCache:
        return MlxCache(len(self.layers), batch)

    def _settle(self) -> None:
        # MLX is lazy: a cut evaluated now stands on its own (a prefix kept
        # for a group's later rows holds none of the prefill batch's arrays).
        self.mx.eval(*[a for c in self.layers if c.keys is not None for a in (c.keys, c.values)])

    def rows(self, index: np.ndarray, drop: int) -> MlxCache:
        out, at = self._new(len(index)), self.mx.array(index)
        for mine, copy in zip(self.layers, out.layers, strict=True):
            k, v = mine.keys_and_values()
            copy.hold(k[at, :, drop:], v[at, :, drop:])
        out._settle()
        return out

    def select(self, index: np.ndarray, drop: int) -> None:
        at = self.mx.array(index)
        for c in self.layers:
            k, v = c.keys_and_values()
            c.hold(k[at, :, drop:], v[at, :, drop:])
        self.batch = len(index)

    def write(self, slots: np.ndarray, other: MlxCache, start: int) -> None:
        # Into the preallocated storage (whose `_idx` is this cache's width);
        # evaluated with the next step.
        at = self.mx.array(slots)
        for mine, new in zip(self.layers, other.layers, strict=True):
            k, v = new.keys_and_values()
            end = start + k.shape[2]
            mine.keys[at, :, start:end] = k
            mine.values[at, :, start:end] = v

    def append(self, rows: np.ndarray, other: MlxCache, width: int) -> None:
        mx, at = self.mx, self.mx.array(rows)
        for mine, theirs in zip(self.layers, other.layers, strict=True):
            (k, v), (k2, v2) = mine.keys_and_values(), theirs.keys_and_values()
            new_k = mx.zeros((self.batch, k2.shape[1], width, k2.shape[3]), dtype=k2.dtype)
            new_v = mx.zeros((self.batch, v2.shape[1], width, v2.shape[3]), dtype=v2.dtype)
            new_k[at] = k2[:, :, -width:]
            new_v[at] = v2[:, :, -width:]
            mine.hold(mx.concatenate([k, new_k], axis=2), mx.concatenate([v, new_v], axis=2))
        self._settle()

    def join(self, other: MlxCache, pad_self: int, pad_other: int) -> None:
        mx = self.mx

        def left(a, columns: int):
            return mx.pad(a, [(0, 0), (0, 0), (columns, 0), (0, 0)]) if columns else a

        for mine, theirs in zip(self.layers, other.layers, strict=True):
            (k, v), (k2, v2) = mine.keys_and_values(), theirs.keys_and_values()
            mine.hold(
                mx.concatenate([left(k, pad_self), left(k2, pad_other)]),
                mx.concatenate([left(v, pad_self), left(v2, pad_other)]),
            )
        self.batch += other.batch

    def gather(self, index: np.ndarray) -> None:
        at = self.mx.array(index)[:, None, :, None]
        for c in self.layers:
            k, v = c.keys_and_values()
            c.hold(self.mx.take_along_axis(k, at, axis=2), self.mx.take_along_axis(v, at, axis=2))

    def begin(self, block, layout) -> None:
        """This step's block: masks are made from it on demand, once per kind."""
        self._block, self._layout, self._masks = block, layout, {}
        width = block.ids.shape[1]
        # RoPE rotates column j of row b by offset_b + j: the position of the
        # row's last (always real) column, counted back. Pad columns get
        # positions below the row's own; they are masked out of every query.
        offset = self.mx.array(block.positions[:, -1] - (width - 1))
        for c in self.layers:
            c.offset = offset

    def mask(self, window: int | None, return_array: bool):
        """This step's attention mask for every layer of one kind (full or windowed)."""
        key = (window, return_array)
        if key not in self._masks:
            self._masks[key] = self._make_mask(window, return_array)
        return self._masks[key]

    def _make_mask(self, window: int | None, return_array: bool):
        from mlx_lm.models.cache import create_attention_mask

        width, keys = self._block.ids.shape[1], self._layout.width
        allowed = self._block.allowed
        if allowed is None:
            # No row was ever padded: every row's positions are its columns.
            return create_attention_mask(width, keys - width, return_array, window)
        if window is not None:
            allowed = self._layout.windowed(allowed, window)
        return self.mx.array(allowed)


class MlxBackend:
    """`backend.Backend` over an `MlxModel` (sampling stays on the CPU, in torch)."""

    name = "mlx"

    def __init__(self, model: MlxModel):
        self.model = model

    @classmethod
    def from_state(cls, skeleton, state, precision: str) -> MlxBackend:
        """A backend over `state` (int8 codes or float) named as `skeleton`'s tensors."""
        from colonnade.model import tied_aliases

        model = MlxModel(skeleton.config, tied_aliases(skeleton), precision)
        model.load(state)
        return cls(model)

    def new_cache(self, batch: int) -> MlxCache:
        return MlxCache(self.model.layers, batch)

    def forward(self, cache: MlxCache, block, layout) -> torch.Tensor:
        mx = cache.mx
        cache.begin(block, layout)
        logits = self.model.last_logits(mx.array(block.ids), cache.layers)
        # MLX is lazy: evaluating the cache with the logits keeps each step's
        # graph from growing into the next one.
        mx.eval(logits, *[a for c in cache.layers for a in (c.keys, c.values)])
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    def refresh(self, state, changed=None) -> None:
        # MlxModel.load rebuilds only the tensors that are new objects.
        self.model.load(state)
