"""Building an engine from a model path at a chosen precision and device."""

from __future__ import annotations

import torch

from colonnade.model import (
    int8_state,
    load_dequantized,
    load_int8,
    load_model,
    pick_device,
    tied_aliases,
)

from .engine import Engine

PRECISIONS = ("int8", "fp32", "bf16")


def load_engine(path: str, precision: str = "int8", device: str = "auto", version: int = 0):
    """An engine over the model at `path`.

    `int8` runs the PULSE int8 codes: on CPU with int8 weight-only linears, on
    CUDA/MPS dequantized to bfloat16 (the same codes, a float kernel).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    dev = pick_device(device)
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    model, tok = load_model(path, dtype=dtype)
    if precision == "int8":
        aliases = tied_aliases(model)
        state = int8_state(model)
        if dev.type == "cpu":
            load_int8(model, state, aliases)
        else:
            load_dequantized(model, state, aliases)
            model.to(torch.bfloat16)
    model.to(dev).eval()
    return Engine(model, tok, version=version)
