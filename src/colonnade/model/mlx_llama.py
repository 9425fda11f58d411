"""Llama-family causal LMs in MLX, running the trainer's published int8 codes.

What this module owns: the MLX forward pass (embedding, RMSNorm, rotary
attention over a grouped KV cache, SwiGLU MLP, head) for the architectures
in `SUPPORTED`, and the translation of PULSE int8 codes into MLX's affine
8-bit layout. The structure (names, shapes, rotary frequencies) is read from
the transformers model the worker already builds from the run's config, so
MLX and torch agree on what a tensor name means.

The layout: MLX stores w = scale · q + bias with q an unsigned byte, one
(scale, bias) per group of 32/64/128 columns. A published row (codes c,
scale s) becomes q = c + 128, every group's scale s and bias −128 · s. MLX
evaluates scale · q and then + bias as two float32 roundings; because the
quantizer keeps 16 significant bits in s (`pulse.quant.round_scale_up`),
both are exact and the dequantized weight is c · s bit for bit, the value
the torch engine multiplies by.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from colonnade.pulse.quant import SCALE_SUFFIX

from .int8 import float_value, lookup, split_linears

SUPPORTED = ("llama", "mistral", "qwen2")
GROUP_SIZES = (128, 64, 32)
PRECISIONS = ("int8", "fp32", "bf16")


class MlxUnavailable(RuntimeError):
    """MLX is not installed (or not importable) on this machine."""


def mlx_missing() -> str | None:
    """Why MLX cannot run here, in one line; None when it can."""
    try:
        import mlx.core  # noqa: F401
    except ImportError as e:
        return (
            f"the MLX engine needs the mlx package ({e}); install it with "
            "`pip install 'colonnade[mlx]'` (Apple silicon, or mlx[cpu] on Linux x86_64)"
        )
    return None


@functools.cache  # called on every layer of every step: import and check once
def _mx():
    reason = mlx_missing()
    if reason:
        raise MlxUnavailable(reason)
    import mlx.core as mx

    return mx


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


class QLinear:
    """y = x · dequant(q)ᵀ + bias on MLX's 8-bit quantized matmul."""

    def __init__(self, layout, bias):
        mx = _mx()
        packed, scales, biases, self.group = layout
        self.q, self.scales, self.biases = mx.array(packed), mx.array(scales), mx.array(biases)
        self.bias = bias

    def __call__(self, x):
        mx = _mx()
        y = mx.quantized_matmul(
            x, self.q, self.scales, self.biases, transpose=True, group_size=self.group, bits=8
        )
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> np.ndarray:
        mx = _mx()
        w = mx.dequantize(self.q, self.scales, self.biases, group_size=self.group, bits=8)
        return np.array(w)


class Dense:
    """y = x · wᵀ + bias with a float weight (float precisions, odd widths)."""

    def __init__(self, weight, bias):
        self.weight, self.bias = weight, bias

    def __call__(self, x):
        y = x @ self.weight.T
        return y if self.bias is None else y + self.bias

    def dequantized(self) -> np.ndarray:
        return np.array(self.weight)


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    eps: float


def _shape(config) -> Shape:
    if config.model_type not in SUPPORTED:
        raise MlxUnavailable(
            f"the MLX engine runs {', '.join(SUPPORTED)} models, not {config.model_type!r}; "
            "use --engine torch"
        )
    heads = config.num_attention_heads
    return Shape(
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        eps=float(config.rms_norm_eps),
    )


def _same(old: tuple | None, new: tuple) -> bool:
    return old is not None and all(a is b for a, b in zip(old, new, strict=True))


def _rotate_half(x, half: int):
    mx = _mx()
    return mx.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class MlxLlama:
    """The forward pass; weights come from a (quantized or float) state by name."""

    def __init__(self, skeleton: torch.nn.Module, aliases: Mapping[str, str], precision: str):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
        mx = _mx()
        self.shape = _shape(skeleton.config)
        self.precision, self.aliases = precision, dict(aliases)
        self.dtype = mx.bfloat16 if precision == "bf16" else mx.float32
        rotary = skeleton.model.rotary_emb
        self.inv_freq = mx.array(rotary.inv_freq.float().numpy())
        self.rope_scale = float(getattr(rotary, "attention_scaling", 1.0))
        self.linear_names, self.tensor_names = split_linears(skeleton)
        self.linears: dict[str, QLinear | Dense] = {}
        self.tensors: dict = {}
        # name -> the torch tensors it was built from, held so that `is` is a
        # sound test (an id could be reused once a tensor is freed).
        self._sources: dict[str, tuple] = {}

    def load(self, state: Mapping[str, torch.Tensor]) -> int:
        """Take a version's state (int8 codes + scales, or float); the tensors rebuilt.

        A PULSE patch leaves unchanged tensors as the same objects, so after
        a patch only the changed ones are laid out again.
        """
        rebuilt = 0
        for name in self.linear_names:
            key = lookup(state, f"{name}.weight", self.aliases)
            bias_t = state.get(f"{name}.bias")
            source = (state[key], state.get(key + SCALE_SUFFIX), bias_t)
            if _same(self._sources.get(name), source):
                continue
            self.linears[name] = self._linear(state, key, bias_t)
            self._sources[name], rebuilt = source, rebuilt + 1
        for name in self.tensor_names:
            key = lookup(state, name, self.aliases)
            source = (state[key], state.get(key + SCALE_SUFFIX))
            if _same(self._sources.get(name), source):
                continue
            self.tensors[name] = self._array(float_value(state, name, self.aliases))
            self._sources[name], rebuilt = source, rebuilt + 1
        return rebuilt

    def _array(self, t: torch.Tensor):
        mx = _mx()
        return mx.array(t.detach().float().numpy()).astype(self.dtype)

    def _linear(self, state, key: str, bias_t):
        bias = None if bias_t is None else self._array(bias_t)
        scale = state.get(key + SCALE_SUFFIX)
        if self.precision == "int8" and scale is not None:
            layout = int8_layout(state[key], scale)
            if layout is not None:
                return QLinear(layout, bias)
        return Dense(self._array(float_value(state, key, {})), bias)

    def __call__(self, ids, positions, mask, cache: list, last_only: bool = True):
        """Logits [B, V] of the last column (or [B, W, V]); `cache` grows in place."""
        mx = _mx()
        if not self.linears:
            raise RuntimeError("no weights loaded: call load(state) first")
        h = self.tensors["model.embed_tokens.weight"][ids]
        freqs = positions[..., None].astype(mx.float32) * self.inv_freq
        emb = mx.concatenate([freqs, freqs], axis=-1)[:, None]  # [B, 1, W, D]
        cos = (mx.cos(emb) * self.rope_scale).astype(self.dtype)
        sin = (mx.sin(emb) * self.rope_scale).astype(self.dtype)
        for i in range(self.shape.layers):
            p = f"model.layers.{i}."
            x = mx.fast.rms_norm(h, self.tensors[p + "input_layernorm.weight"], self.shape.eps)
            h = h + self._attention(p, i, x, cos, sin, mask, cache)
            x = mx.fast.rms_norm(
                h, self.tensors[p + "post_attention_layernorm.weight"], self.shape.eps
            )
            h = h + self._mlp(p, x)
        h = mx.fast.rms_norm(h, self.tensors["model.norm.weight"], self.shape.eps)
        if last_only:
            h = h[:, -1, :]
        return self.linears["lm_head"](h)

    def _attention(self, p: str, i: int, x, cos, sin, mask, cache: list):
        mx = _mx()
        s = self.shape
        batch, width, _ = x.shape
        lin = self.linears

        def heads(name: str, n: int):
            y = lin[p + f"self_attn.{name}_proj"](x).reshape(batch, width, n, s.head_dim)
            return y.transpose(0, 2, 1, 3)

        half = s.head_dim // 2
        q, k, v = heads("q", s.heads), heads("k", s.kv_heads), heads("v", s.kv_heads)
        q = q * cos + _rotate_half(q, half) * sin
        k = k * cos + _rotate_half(k, half) * sin
        if cache[i] is not None:
            k = mx.concatenate([cache[i][0], k], axis=2)
            v = mx.concatenate([cache[i][1], v], axis=2)
        cache[i] = (k, v)
        o = mx.fast.scaled_dot_product_attention(q, k, v, scale=s.head_dim**-0.5, mask=mask)
        o = o.transpose(0, 2, 1, 3).reshape(batch, width, s.heads * s.head_dim)
        return lin[p + "self_attn.o_proj"](o)

    def _mlp(self, p: str, x):
        mx = _mx()
        lin = self.linears
        gate = lin[p + "mlp.gate_proj"](x)
        return lin[p + "mlp.down_proj"](gate * mx.sigmoid(gate) * lin[p + "mlp.up_proj"](x))

    def sequence_logprobs(self, ids: list[int], start: int, temperature: float = 1.0):
        """Log-probs (torch, float32) of ids[start:] given their prefixes, one pass."""
        from .logprobs import gather_logprobs

        mx = _mx()
        if not 0 < start < len(ids):
            raise ValueError("start must leave a prefix and at least one scored token")
        x = mx.array([ids])
        positions = mx.arange(len(ids))[None]
        logits = self(x, positions, "causal", [None] * self.shape.layers, last_only=False)
        logits = torch.from_numpy(np.array(logits[0, start - 1 : -1].astype(mx.float32)))
        return gather_logprobs(logits, torch.tensor(ids[start:]), temperature)
