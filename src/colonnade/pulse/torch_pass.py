"""The element pass in torch: for a state that lives on a GPU.

When the trainer's weights are on a GPU, comparing old and new, classifying
each element by its context and gathering the changed ones all run there as
torch ops, and only the changes (a small share of the elements: their positions,
ranks and two residual transforms) and each chunk's class sizes cross to the
CPU, where positions.RiceEncoder and the range coder take them as they take
the compiled pass's (kernels.class_ranks). Chunk for chunk it returns what
that pass returns, so the patch is the same to the byte; on CPU tensors the
tests hold it to that. Called by codec._encode_tensor for CUDA tensors (or
wherever codec.ELEMENT_PASS = "torch" says).

Ranks come from a stable sort of the chunk's classes (elements class-major,
ascending within a class): a changed element's place in that order, less its
class's offset, is its rank. That is a chunk's worth of device memory per
step, never a copy of the state.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from . import kernels
from .context import _EXPONENT, N_CLASSES, exponent_reference, sampled
from .quant import SCALE_SUFFIX
from .tensors import dtype_name

_SIGNED = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UNSIGNED_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def bits_of(t: torch.Tensor) -> torch.Tensor:
    """Flat signed-integer view of a tensor's bits, on its own device."""
    flat = t.detach().contiguous().reshape(-1)
    return flat.view(_SIGNED[flat.element_size()])


def _field(bits: torch.Tensor, dtype: str) -> torch.Tensor:
    # Arithmetic shift of a signed view, then the mask: the sign bit lies
    # above the field, so the result is the exponent field as the CPU's is.
    shift, mask = _EXPONENT[dtype]
    return (bits >> shift) & mask


class DeviceClasses:
    """Per-element context classes on the device (context.ClassMap's rules)."""

    def __init__(self, ctx: str, name: str, state: Mapping[str, torch.Tensor], bits) -> None:
        base = state[name]
        self.ctx, self.dtype, self.bits = ctx, dtype_name(base), bits
        self.rows: torch.Tensor | None = None
        self.e0 = 0
        if ctx == "rowscale":
            scale = bits_of(state[name + SCALE_SUFFIX].to(bits.device))
            self.rows, self.cols = _field(scale, "F32").to(torch.int64), max(base.shape[1], 1)
            if self.rows.numel():
                self.e0 = exponent_reference(int(self.rows.max()), below=0)
        elif ctx == "exp" and bits.numel():
            top = int(_field(bits[sampled(bits.numel())], self.dtype).max())
            self.e0 = exponent_reference(top)

    def classes(self, start: int, stop: int) -> torch.Tensor:
        """uint8 class of each element in [start, stop)."""
        if self.ctx == "exp":
            e = _field(self.bits[start:stop], self.dtype).to(torch.int64)
            return (e - self.e0).clamp_(0, N_CLASSES - 1).to(torch.uint8)
        if self.ctx == "rowscale" and self.rows is not None:
            lo, hi = start // self.cols, -(-stop // self.cols)
            rows = (self.rows[lo:hi] - self.e0).clamp_(0, N_CLASSES - 1).to(torch.uint8)
            rep = rows.repeat_interleave(self.cols)
            return rep[start - lo * self.cols : stop - lo * self.cols]
        return torch.zeros(stop - start, dtype=torch.uint8, device=self.bits.device)


def _transforms(o: torch.Tensor, n: torch.Tensor, key: int, width: int):
    """(XOR, zigzag key delta) of changed elements, as unsigned numpy arrays."""
    ut = _UNSIGNED_NP[width // 8]
    if width == 64:  # no unsigned 64-bit arithmetic to lean on: numpy's, on the CPU
        o_np, n_np = o.cpu().numpy().view(ut), n.cpu().numpy().view(ut)
        return kernels.residual_transforms(o_np, n_np, key)
    mask, top = (1 << width) - 1, 1 << (width - 1)
    o64, n64 = o.to(torch.int64) & mask, n.to(torch.int64) & mask
    xor = o64 ^ n64
    if key == kernels.KEY_FLOAT:
        o64 = torch.where(o64 & top != 0, ~o64 & mask, o64 | top)
        n64 = torch.where(n64 & top != 0, ~n64 & mask, n64 | top)
    elif key == kernels.KEY_SIGNED:
        o64, n64 = o64 ^ top, n64 ^ top
    d = (n64 - o64) & mask
    delta = torch.where(d & top != 0, ~(d << 1) & mask, (d << 1) & mask)

    def out(x: torch.Tensor) -> np.ndarray:
        return x.to(_SIGNED[width // 8]).cpu().numpy().view(ut)

    return out(xor), out(delta)


def chunk_changes(cls: torch.Tensor, old: torch.Tensor, new: torch.Tensor, key: int) -> tuple:
    """kernels.class_ranks(…, key=key) of one chunk, computed where the bits are."""
    width = old.element_size() * 8
    counts = torch.bincount(cls.to(torch.int64), minlength=N_CLASSES)
    sorted_cls, perm = torch.sort(cls, stable=True)
    pos = torch.nonzero((old != new)[perm]).reshape(-1)
    order = perm[pos]
    cls_of = sorted_cls[pos].to(torch.int64)
    offsets = torch.cumsum(counts, 0) - counts
    ranks = pos - offsets[cls_of]
    per_class = torch.bincount(cls_of, minlength=N_CLASSES)
    xor, delta = _transforms(old[order], new[order], key, width)

    def small(x: torch.Tensor, dt) -> np.ndarray:
        return x.cpu().numpy().astype(dt, copy=False)

    return (
        small(order, np.int32),
        small(ranks, np.int32),
        small(counts, np.int64),
        small(per_class, np.int64),
        xor,
        delta,
    )


def changes(
    name: str,
    ctx: str,
    state: Mapping[str, torch.Tensor],
    old: torch.Tensor,
    new: torch.Tensor,
    chunk: int,
    key: int,
):
    """(e0, changes of each chunk in order) of one tensor, old and new on one device."""
    ob, nb = bits_of(old), bits_of(new)
    cmap = DeviceClasses(ctx, name, state, ob)
    found = []
    for start in range(0, ob.numel(), chunk):
        stop = min(ob.numel(), start + chunk)
        cls = cmap.classes(start, stop)
        found.append(chunk_changes(cls, ob[start:stop], nb[start:stop], key))
    return cmap.e0, found
