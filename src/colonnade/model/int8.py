"""The weights workers run: PULSE int8 codes on a real int8 CPU kernel.

The trainer publishes per-row symmetric int8 codes and float32 row scales
(`colonnade.pulse.quant`, one implementation for both sides). On CPU every
2-D linear weight becomes a torch dynamic-quantized linear (fbgemm) holding
exactly those codes and scales, so the weights a worker runs dequantize bit
for bit to the ones the trainer hashed. Embedding tables are gathered, not
multiplied, so they run dequantized in float32. On CUDA/MPS the same codes
run dequantized (fbgemm is CPU only).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.ao.nn.quantized import dynamic as nnqd

from colonnade.pulse.quant import SCALE_SUFFIX, dequantize_rows, quantize_state


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """{name: first name} for parameters sharing storage (tied embeddings)."""
    seen: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        key = t.data_ptr()
        if key in seen and t.numel() > 0:
            aliases[name] = seen[key]
        else:
            seen[key] = name
    return aliases


def publishable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors once each (a tied head is published as its embedding)."""
    aliases = tied_aliases(model)
    return {k: v.detach() for k, v in model.state_dict().items() if k not in aliases}


def int8_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return quantize_state(publishable_state(model))


def _int8_linear(codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    out_f, in_f = codes.shape
    zeros = torch.zeros(out_f, dtype=torch.int64)
    # Scales travel as float32; a float64 copy holds them exactly, and
    # int8 x float32 products are exact in float64, so dequantized weights
    # round to the very float32 values dequantize_rows gives.
    with warnings.catch_warnings():
        # torch 2.13 flags quantized-tensor constructors as deprecated; they
        # are still the only way to hand fbgemm precomputed codes.
        warnings.simplefilter("ignore", UserWarning)
        weight = torch._make_per_channel_quantized_tensor(codes, scale.double(), zeros, 0)
    layer = nnqd.Linear(in_f, out_f, bias_=bias is not None, dtype=torch.qint8)
    layer.set_weight_bias(weight, None if bias is None else bias.float())
    return layer


def _lookup(qstate: Mapping[str, torch.Tensor], name: str, aliases: Mapping[str, str]) -> str:
    key = aliases.get(name, name)
    if key not in qstate:
        raise KeyError(f"int8 state has no tensor {key!r}")
    return key


def _float_value(qstate: Mapping[str, torch.Tensor], name: str, aliases: Mapping[str, str]):
    """The model tensor `name` from an int8 state: dequantized if it has row scales."""
    key = _lookup(qstate, name, aliases)
    scale = qstate.get(key + SCALE_SUFFIX)
    return qstate[key] if scale is None else dequantize_rows(qstate[key], scale)


def _copy_into(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    # Not load_state_dict: quantized linears insist on their own keys in it.
    with torch.no_grad():
        for name, value in tensors.items():
            mod_name, _, attr = name.rpartition(".")
            target = getattr(model.get_submodule(mod_name) if mod_name else model, attr)
            if target.shape != value.shape:
                raise ValueError(
                    f"{name}: shape {tuple(value.shape)}, model wants {tuple(target.shape)}"
                )
            target.copy_(value)


def load_int8(model: nn.Module, qstate: Mapping[str, torch.Tensor], aliases: Mapping[str, str]):
    """Run `qstate` (codes + scales) in `model` on CPU: linears become int8.

    `aliases` comes from `tied_aliases` on the float model (before the first
    call: a swapped model no longer shows its ties). Calling again with a
    newer state replaces the weights in place of the previous ones.
    """
    linears = [
        (name, mod)
        for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear | nnqd.Linear)
    ]
    linear_names = {name for name, _ in linears}
    rest = {}
    for name in model.state_dict():
        if name.rpartition(".")[0] in linear_names or "._packed_params" in name:
            continue
        rest[name] = _float_value(qstate, name, aliases)
    for name, _ in linears:
        key = _lookup(qstate, f"{name}.weight", aliases)
        layer = _int8_linear(qstate[key], qstate[key + SCALE_SUFFIX], qstate.get(f"{name}.bias"))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, layer)
    _copy_into(model, rest)
    return model


def load_dequantized(
    model: nn.Module, qstate: Mapping[str, torch.Tensor], aliases: Mapping[str, str]
) -> nn.Module:
    """The same int8 weights, dequantized into a float model (CUDA, MPS)."""
    model.load_state_dict(
        {name: _float_value(qstate, name, aliases) for name in model.state_dict()}
    )
    return model
