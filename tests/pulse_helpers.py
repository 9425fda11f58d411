"""Shared helpers for the PULSE tests: bit-exact comparison, perturbed states."""

from __future__ import annotations

import torch

from colonnade.pulse.tensors import to_bits


def bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    if set(a) != set(b):
        return False
    for k in a:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape:
            return False
        if not (to_bits(a[k]) == to_bits(b[k])).all():
            return False
    return True


def perturb(t: torch.Tensor, density: float, gen: torch.Generator) -> torch.Tensor:
    """A copy of t with about `density` of its elements changed (bits differ)."""
    out = t.clone()
    if t.numel() == 0:
        return out
    flat = out.reshape(-1)
    pick = torch.rand(flat.shape, generator=gen) < density
    if t.dtype == torch.bool:
        flat[pick] = ~flat[pick]
    elif t.is_floating_point():
        step = torch.randn(flat.shape, generator=gen, dtype=torch.float32) * 1e-2
        moved = (flat.float() * (1 + step) + step).to(t.dtype)
        flat[pick] = moved[pick]
    else:
        lo = torch.iinfo(t.dtype).min
        hi = torch.iinfo(t.dtype).max
        noise = torch.randint(lo, hi, flat.shape, generator=gen, dtype=torch.int64)
        flat[pick] = noise[pick].to(t.dtype)
    return out


def random_tensor(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) < 0.5
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 0.05).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=gen, dtype=torch.int64).to(dtype)
