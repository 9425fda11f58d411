"""Building engines: the one way a published state becomes an engine.

`engine_for(model, tokenizer, state, …)` puts a state as workers hold it
(`pulse.prepare(…, precision)`: int8 codes and row scales, or bf16) into an
engine: torch on CPU runs the int8 codes on int8 linears; on CUDA/MPS the
codes are dequantized to float32 (exactly the published values); MLX lays
them out in its 8-bit format. `refresh` puts a newer state into the same
engine in place, the changed tensors only. Everything that runs a model on
published weights uses these two: the worker, `colonnade eval` and the run's
evaluations (`load_engine` for a model directory quantizes with the
publisher's own `pulse.prepare`), so an evaluation runs the codes workers
run.
"""

from __future__ import annotations

import logging
import platform
import sys

import torch

from colonnade import pulse
from colonnade.model import (
    load_dequantized,
    load_int8,
    load_model,
    pick_device,
    publishable_state,
    tied_aliases,
)

from .engine import Engine
from .mlx_engine import ARCHITECTURES, MlxUnavailable, UnsupportedArchitecture, mlx_missing

PRECISIONS = ("int8", "fp32", "bf16")
ENGINES = ("auto", "torch", "mlx")

log = logging.getLogger("colonnade.engine")


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def engines_supporting(model_type: str) -> list[str]:
    """The engines that run `model_type` models (torch: what transformers builds)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kinds = ["torch"] if model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else []
    return kinds + (["mlx"] if model_type in ARCHITECTURES else [])


def check_architecture(kind: str, model_type: str) -> None:
    """UnsupportedArchitecture, in one line, when engine `kind` cannot run `model_type`."""
    others = engines_supporting(model_type)
    if kind in others:
        return
    which = f"engines that do: {', '.join(others)}" if others else "no engine of colonnade does"
    raise UnsupportedArchitecture(
        f"the {kind} engine does not run {model_type!r} models; {which} "
        f"(mlx runs {', '.join(ARCHITECTURES)})"
    )


def resolve_engine(name: str, model_type: str | None = None) -> str:
    """`torch` or `mlx` for an --engine choice; MlxUnavailable if `mlx` cannot run.

    `auto` is MLX on Apple silicon when it is installed and runs `model_type`
    (when given), torch elsewhere. With `model_type`, an engine that does not
    run it is UnsupportedArchitecture: call this with the run's config before
    any weights are fetched.
    """
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINES)}")
    kind = _resolve(name, model_type)
    if model_type is not None:
        check_architecture(kind, model_type)
    return kind


def _resolve(name: str, model_type: str | None) -> str:
    if name == "torch" or (name == "auto" and not apple_silicon()):
        return "torch"
    if name == "auto" and model_type is not None and model_type not in ARCHITECTURES:
        log.warning("the MLX engine does not run %r models: using the torch engine", model_type)
        return "torch"
    reason = mlx_missing()
    if reason is None:
        return "mlx"
    if name == "mlx":
        raise MlxUnavailable(reason)
    log.warning("%s: using the torch engine", reason)
    return "torch"


def _load(model, state, aliases, precision: str, device: torch.device, changed=None) -> None:
    if precision == "int8" and device.type == "cpu":
        load_int8(model, state, aliases, changed)
    else:
        load_dequantized(model, state, aliases, changed)


def engine_for(
    model,
    tokenizer,
    state,
    precision: str,
    device: torch.device,
    kind: str = "torch",
    version: int = 0,
    aliases: dict[str, str] | None = None,
) -> Engine:
    """An engine running `state` (a prepared state at `precision`) in `model`,
    a float32 model of the run's architecture (modified in place on torch).

    `aliases`: `tied_aliases(model)`, taken before the model was ever loaded
    with int8 linears (a swapped model no longer shows its ties)."""
    if kind == "mlx":
        from .mlx_engine import MlxEngine

        return MlxEngine.from_state(model, tokenizer, state, precision, version)
    aliases = tied_aliases(model) if aliases is None else aliases
    _load(model, state, aliases, precision, device)
    return Engine(model.to(device).eval(), tokenizer, version=version)


def refresh(engine: Engine, state, aliases, precision: str, changed, version: int) -> None:
    """A newer state into `engine` in place: the `changed` keys only (None: all)."""
    if engine.name == "mlx":
        engine.model.load(state)  # the tensors that changed since its last load, in place
    else:
        _load(engine.model, state, aliases, precision, engine.device, changed)
    engine.version = version


def load_engine(
    path: str,
    precision: str = "int8",
    device: str = "auto",
    version: int = 0,
    engine: str = "torch",
):
    """An engine over the model directory at `path`, at `precision`.

    `int8` and `bf16` run what a trainer would publish from these weights
    (`pulse.prepare`, the one quantizer); `fp32` runs them as they are.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    from transformers import AutoConfig

    # The architecture is checked from config.json, before any weights load.
    kind = resolve_engine(engine, AutoConfig.from_pretrained(path).model_type)
    dev = torch.device("cpu") if kind == "mlx" else pick_device(device)
    model, tok = load_model(path, dtype=torch.float32)
    if precision == "fp32" and kind == "torch":
        return Engine(model.to(dev).eval(), tok, version=version)
    prepared = "exact" if precision == "fp32" else precision
    state = pulse.prepare(publishable_state(model), prepared)
    return engine_for(model, tok, state, precision, dev, kind, version)
