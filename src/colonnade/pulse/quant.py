"""Deterministic per-output-row symmetric int8 quantization.

One implementation for the trainer (which publishes int8 codes) and the
rollout engine (which runs them): workers execute exactly the codes the
trainer hashed, so the behaviour policy is known bit for bit.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

SCALE_SUFFIX = "::scale"
QMAX = 127
SCALE_BITS = 16  # significant bits kept in a row scale
# LoRA adapters (`model/lora.py`) stay bf16: they are small, and per-row int8
# steps on a low-rank update would be most of the update.
ADAPTER_MARKS = (".lora_A.", ".lora_B.")


def is_adapter(name: str) -> bool:
    """Whether the state tensor `name` is a LoRA adapter's (never int8)."""
    return any(m in name for m in ADAPTER_MARKS)


def round_scale_up(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales rounded up to SCALE_BITS significant bits.

    With 16-bit scales every product scale × q (|q| ≤ 255, 8 bits) is exact
    in float32. That makes the codes mean the same float on any engine:
    torch's codes × scale, and MLX's affine layout scale × (code + 128) −
    128 · scale, which MLX evaluates as two rounded operations (no fma).
    Rounding up keeps |w / scale| ≤ 127; the cost is a relative change of
    the scale below 2⁻¹⁵, far inside the int8 step.
    """
    drop = 24 - SCALE_BITS
    bits = scale.contiguous().view(torch.int32)
    return ((bits + ((1 << drop) - 1)) & ~((1 << drop) - 1)).view(torch.float32)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (int8, same shape) and per-row float32 scales of a 2-D weight.

    scale = max|row| / 127 in float32 rounded up to 16 significant bits
    (`round_scale_up`), codes = round-half-even(w / scale). Every step is a
    correctly rounded IEEE operation or an integer one on float32 bits, so any
    machine computes the same codes from the same input bits.
    """
    if w.ndim != 2 or not w.is_floating_point():
        raise ValueError(f"quantize_rows wants a 2-D float tensor, got {w.dtype} {tuple(w.shape)}")
    w32 = w.detach().to(device="cpu", dtype=torch.float32)
    scale = round_scale_up(w32.abs().amax(dim=1) / QMAX)
    # An all-zero row keeps scale 0 and codes 0; dividing by 1 avoids 0/0.
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    codes = torch.round(w32 / safe[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return codes, scale


def dequantize_rows(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return codes.to(torch.float32) * scale.to(torch.float32)[:, None]


def published_value(t: torch.Tensor, precision: str, adapter: bool = False) -> torch.Tensor:
    """What a worker computes with for `t` at `precision` (codec.prepare's
    rounding, dequantized), in t's dtype and on its device: "exact" as it is,
    "bf16" rounded to bf16, "int8" a 2-D weight's bf16 codes × row scales
    (other tensors, and a LoRA `adapter`'s, bf16). For a trainer that runs its forward on what the
    workers run (`train.policy.weights_as_published`)."""
    if precision == "exact" or not t.is_floating_point():
        return t
    if precision not in ("bf16", "int8"):
        raise ValueError(f"precision must be exact, bf16 or int8, not {precision!r}")
    bf = t.to(torch.bfloat16)
    if precision == "int8" and is_quantizable(t) and not adapter:
        return dequantize_rows(*quantize_rows(bf)).to(device=t.device, dtype=t.dtype)
    return bf.to(t.dtype)


def is_quantizable(t: torch.Tensor) -> bool:
    return t.ndim == 2 and t.is_floating_point()


def quantize_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """int8 view of a model state: 2-D float weights become codes + scales.

    `name` holds the int8 codes and `name + "::scale"` the float32 row scales;
    every other tensor (norms, biases, LoRA adapters) stays as it is.
    Idempotent: an already-quantized state comes back as it is.
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        if name.endswith(SCALE_SUFFIX):
            codes = state.get(name[: -len(SCALE_SUFFIX)])
            if codes is None or codes.dtype != torch.int8:
                raise ValueError(f"tensor name {name!r} collides with the int8 scale suffix")
            out[name] = t
        elif is_quantizable(t) and not is_adapter(name):
            out[name], out[name + SCALE_SUFFIX] = quantize_rows(t)
        else:
            out[name] = t
    return out


def dequantize_state(qstate: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """float32 weights of an int8 state (codes × row scales), others unchanged."""
    out: dict[str, torch.Tensor] = {}
    for name, t in qstate.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = qstate.get(name + SCALE_SUFFIX)
        out[name] = dequantize_rows(t, scale) if scale is not None else t
    return out
