"""Context classes: what both sides know about an element before decoding it.

Whether an element changes in one optimizer step depends on its base value: a
step of ~lr crosses a bf16 rounding boundary far more often where the ulp is
small. Grouping elements by the exponent of their base value (or, for int8
codes, by the exponent of their row's scale) and coding each group on its own
spends fewer bits than one density for the whole tensor. The receiver holds
the base, so the grouping costs nothing to transmit but one reference number.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
import torch

from . import kernels
from .quant import SCALE_SUFFIX
from .tensors import FLOAT_DTYPES, dtype_name, to_bits

N_CLASSES = kernels.N_CLASSES
_NONE = np.zeros(1, np.uint8)


def _zeros(n: int) -> np.ndarray:
    return np.zeros(n, np.uint8)


# (shift, mask) of the exponent field per float dtype.
_EXPONENT = {"BF16": (7, 0xFF), "F16": (10, 0x1F), "F32": (23, 0xFF), "F64": (52, 0x7FF)}

# A float tensor's classes are anchored BELOW_TOP binades under the largest
# exponent of a sample of its elements (`sampled`). The largest magnitudes
# change least: a top class shared by the top two binades costs less than
# merging two more of the small ones, which change most, where a few
# outliers stand above the rest (pretrained weights); and the sample reads a
# few hundred cache lines of the base where the exact maximum read all of it.
# docs/benchmarks.md has the sizes ("Classes anchored on a sample"). The
# decoder reads e0 from the patch, so this rule is the encoder's alone.
SAMPLE_STRIDE = 4096
SAMPLE_COUNT = 256
BELOW_TOP = 1


def sampled(n: int) -> slice:
    """The elements of a flat tensor of n whose largest exponent anchors its
    classes: one in SAMPLE_STRIDE, or SAMPLE_COUNT spread evenly where that
    is more (all of a tensor under 2 · SAMPLE_COUNT elements)."""
    return slice(None, None, min(SAMPLE_STRIDE, max(1, n // SAMPLE_COUNT)))


def exponent_reference(top: int, below: int = BELOW_TOP) -> int:
    """e0 whose top class holds exponent `top` and the `below` binades under
    it: a float tensor's sampled largest exponent field, BELOW_TOP; an int8
    tensor's largest row-scale exponent, 0."""
    return max(0, top - (N_CLASSES - 1) - below)


def exponent_field(bits: np.ndarray, dtype: str) -> np.ndarray:
    shift, mask = _EXPONENT[dtype]
    ut = bits.dtype.type
    return ((bits >> ut(shift)) & ut(mask)).astype(np.int32)


def choose_context(name: str, base: torch.Tensor, state: Mapping[str, torch.Tensor]) -> str:
    dtype = dtype_name(base)
    if dtype in FLOAT_DTYPES:
        return "exp"
    scale = state.get(name + SCALE_SUFFIX)
    if (
        dtype == "I8"
        and base.ndim == 2
        and scale is not None
        and dtype_name(scale) == "F32"
        and tuple(scale.shape) == (base.shape[0],)
    ):
        return "rowscale"
    return "none"


@functools.cache
def _exponent_lut(dtype: str, itemsize: int, e0: int) -> np.ndarray:
    """Class of each sign+exponent value (read-only; shared by every tensor
    of this dtype and e0: a patch has hundreds of tensors and few e0s)."""
    shift, mask = _EXPONENT[dtype]
    top = np.arange(1 << (itemsize * 8 - shift), dtype=np.int64)
    table = np.clip((top & mask) - e0, 0, N_CLASSES - 1).astype(np.uint8)
    table.flags.writeable = False
    return table


class ClassMap:
    """Per-element classes of one base tensor, computed chunk by chunk.

    Chunked so that a 500M-element embedding never needs a 2 GB int32 copy.
    The reference exponent e0: a class is an exponent minus e0, clipped to
    0..15. Everything 15 or more binades below e0's top class shares class
    0, where nearly every element changes. For a float tensor it follows
    `exponent_reference`; for int8 codes, the largest row-scale exponent
    anchors the top class.
    """

    def __init__(
        self,
        ctx: str,
        dtype: str,
        base_bits: np.ndarray,
        scale_bits: np.ndarray | None,
        cols: int,
        e0: int | None = None,
    ) -> None:
        self.ctx, self.dtype, self.bits, self.cols = ctx, dtype, base_bits, max(cols, 1)
        self.rows = exponent_field(scale_bits, "F32") if ctx == "rowscale" else None
        self.e0 = self._reference() if e0 is None else e0
        self._table: np.ndarray | None = None

    def _reference(self) -> int:
        if self.ctx == "rowscale" and self.rows is not None and self.rows.size:
            return exponent_reference(int(self.rows.max()), below=0)
        if self.ctx == "exp" and self.bits.size:
            # The exponent field lies right under the sign bit.
            top = kernels.top_magnitude(self.bits[sampled(self.bits.size)])
            return exponent_reference(top >> _EXPONENT[self.dtype][0])
        return 0

    def _lut(self) -> np.ndarray:
        if self._table is None:
            self._table = _exponent_lut(self.dtype, self.bits.dtype.itemsize, self.e0)
        return self._table

    def source(self, start: int, stop: int) -> kernels.ClassSource:
        """What the compiled kernels need to compute the classes of [start, stop)."""
        if self.ctx == "exp":
            shift, _ = _EXPONENT[self.dtype]
            return kernels.ClassSource(kernels.MODE_LUT, self._lut(), shift, _NONE)
        if self.ctx == "rowscale":
            return kernels.ClassSource(kernels.MODE_ARRAY, _NONE, 0, self.classes(start, stop))
        # One class: a table of zeros over the top 16 bits (or all 8 of a byte).
        width = self.bits.dtype.itemsize * 8
        shift = max(0, width - 16)
        return kernels.ClassSource(kernels.MODE_LUT, _zeros(1 << (width - shift)), shift, _NONE)

    def classes(self, start: int, stop: int) -> np.ndarray:
        """uint8 class of each element in [start, stop) of the flattened tensor."""
        if self.ctx == "exp":
            # One table look-up on sign+exponent instead of shift, mask, clip, cast.
            shift, _ = _EXPONENT[self.dtype]
            ut = self.bits.dtype.type
            return np.take(self._lut(), self.bits[start:stop] >> ut(shift))
        if self.ctx == "rowscale" and self.rows is not None:
            lo, hi = start // self.cols, -(-stop // self.cols)
            rows = np.clip(self.rows[lo:hi] - self.e0, 0, N_CLASSES - 1).astype(np.uint8)
            return np.repeat(rows, self.cols)[start - lo * self.cols : stop - lo * self.cols]
        return np.zeros(stop - start, dtype=np.uint8)


def class_map(
    name: str,
    ctx: str,
    state: Mapping[str, torch.Tensor],
    base_bits: np.ndarray,
    e0: int | None = None,
) -> ClassMap:
    base = state[name]
    scale = to_bits(state[name + SCALE_SUFFIX]) if ctx == "rowscale" else None
    cols = base.shape[1] if ctx == "rowscale" else 1
    return ClassMap(ctx, dtype_name(base), base_bits, scale, cols, e0)
