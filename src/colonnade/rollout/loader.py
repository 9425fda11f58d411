"""Building an engine from a model path: which engine, precision and device."""

from __future__ import annotations

import logging
import platform
import sys

import torch

from colonnade.model import (
    int8_state,
    load_dequantized,
    load_int8,
    load_model,
    pick_device,
    tied_aliases,
)
from colonnade.model.mlx_llama import MlxUnavailable, mlx_missing

from .engine import Engine

PRECISIONS = ("int8", "fp32", "bf16")
ENGINES = ("auto", "torch", "mlx")

log = logging.getLogger("colonnade.engine")


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def resolve_engine(name: str) -> str:
    """`torch` or `mlx` for an --engine choice; MlxUnavailable if `mlx` cannot run.

    `auto` is MLX on Apple silicon when it is installed, torch elsewhere.
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    if name == "torch" or (name == "auto" and not apple_silicon()):
        return "torch"
    reason = mlx_missing()
    if reason is None:
        return "mlx"
    if name == "mlx":
        raise MlxUnavailable(reason)
    log.warning("%s: using the torch engine", reason)
    return "torch"


def load_engine(
    path: str,
    precision: str = "int8",
    device: str = "auto",
    version: int = 0,
    engine: str = "torch",
):
    """An engine over the model at `path`.

    `int8` runs the PULSE int8 codes: with torch on CPU with int8 weight-only
    linears, on CUDA/MPS dequantized to bfloat16 (the same codes, a float
    kernel); with MLX in its 8-bit quantized layout.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if resolve_engine(engine) == "mlx":
        return _load_mlx(path, precision, version)
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


def _load_mlx(path: str, precision: str, version: int):
    from .mlx_engine import MlxEngine

    model, tok = load_model(path, dtype=torch.float32)
    state = int8_state(model) if precision == "int8" else dict(model.state_dict())
    return MlxEngine.from_state(model, tok, state, precision, version)
