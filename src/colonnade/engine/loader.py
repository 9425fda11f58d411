"""Building engines: the one way a published state becomes an engine.

`engine_for(model, tokenizer, state, …)` puts a state as workers hold it
(`pulse.prepare(…, precision)`: int8 codes and row scales, or bf16) into a
backend: torch on CPU runs the int8 codes on int8 linears; on CUDA/MPS the
codes are dequantized to float32 (exactly the published values); MLX lays
them out in its 8-bit format. `Backend.refresh` puts a newer state into the
same engine in place, the changed tensors only. Everything that runs a
model on published weights uses these: the worker, `colonnade eval` and the
run's evaluations (`load_engine` for a model directory quantizes with the
publisher's own `pulse.prepare`), so an evaluation runs the codes workers
run.

A backend is listed once, in `BACKENDS`, with what it runs and how it is
built; nothing else names backends.
"""

from __future__ import annotations

import logging
import platform
import sys
from collections.abc import Callable, Set
from dataclasses import dataclass

import torch

from colonnade import pulse
from colonnade.choices import ENGINE_CHOICES, RUN_PRECISIONS
from colonnade.model import (
    load_dequantized,
    load_int8,
    load_model,
    pick_device,
    publishable_state,
    tied_aliases,
)
from colonnade.model.unmerged import load_adapters

from .backend import Backend, BackendUnavailable, UnsupportedArchitecture
from .loop import Engine
from .mlx_backend import ARCHITECTURES, mlx_missing

log = logging.getLogger("colonnade.engine")


def load_torch(
    model, state, aliases, precision: str, device: torch.device, changed=None, share=False
) -> bool:
    """A prepared state into a transformers model: int8 linears on CPU, floats
    elsewhere, LoRA adapters unmerged beside them (`model.unmerged`); whether
    the adapted modules changed (`load_adapters`). `share`: int8 layers hold
    the state's codes, not copies (`model.int8.load_int8`)."""
    if precision == "int8" and device.type == "cpu":
        load_int8(model, state, aliases, changed, share=share)
    else:
        load_dequantized(model, state, aliases, changed)
    return load_adapters(model, state, changed)


def _torch_runs(model_type: str) -> bool:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _build_torch(model, state, precision: str, device: torch.device, aliases, compile) -> Backend:
    from .torch_backend import TorchBackend

    load_torch(model, state, aliases, precision, device)
    return TorchBackend(model.to(device).eval(), precision, aliases, compile)


def _build_mlx(model, state, precision: str, device: torch.device, aliases, compile) -> Backend:
    from .mlx_backend import MlxBackend

    return MlxBackend.from_state(model, state, precision)


@dataclass(frozen=True)
class BackendSpec:
    runs: Callable[[str], bool]  # model_type -> does it run this architecture?
    missing: Callable[[], str | None]  # why it cannot run on this machine, or None
    # (float32 model, state, precision, device, aliases, compile: off/on/auto
    # or None, for backends that compile their step)
    build: Callable[..., Backend]
    host_only: bool  # runs on its own device: the torch model stays on the CPU


BACKENDS: dict[str, BackendSpec] = {
    "torch": BackendSpec(_torch_runs, lambda: None, _build_torch, host_only=False),
    # Late-bound (lambdas): what MLX runs and whether it is installed are read when asked.
    "mlx": BackendSpec(
        lambda t: t in ARCHITECTURES, lambda: mlx_missing(), _build_mlx, host_only=True
    ),
}


def apple_silicon() -> bool:
    return sys.platform == "darwin" and platform.machine() == "arm64"


def engines_supporting(model_type: str) -> list[str]:
    """The backends that run `model_type` models."""
    return [name for name, spec in BACKENDS.items() if spec.runs(model_type)]


def check_architecture(kind: str, model_type: str) -> None:
    """UnsupportedArchitecture, in one line, when backend `kind` cannot run `model_type`."""
    others = engines_supporting(model_type)
    if kind in others:
        return
    which = f"engines that do: {', '.join(others)}" if others else "no engine of colonnade does"
    raise UnsupportedArchitecture(
        f"the {kind} engine does not run {model_type!r} models; {which} "
        f"(mlx runs {', '.join(ARCHITECTURES)})"
    )


def resolve_engine(name: str, model_type: str | None = None) -> str:
    """A backend name for an --engine choice; BackendUnavailable if it cannot run here.

    `auto` is MLX on Apple silicon when it is installed and runs `model_type`
    (when given), torch elsewhere. With `model_type`, a backend that does not
    run it is UnsupportedArchitecture: call this with the run's config before
    any weights are fetched.
    """
    if name not in ENGINE_CHOICES:
        raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_CHOICES)}")
    kind = _resolve(name, model_type)
    if model_type is not None:
        check_architecture(kind, model_type)
    return kind


def _resolve(name: str, model_type: str | None) -> str:
    if name == "auto":
        if not apple_silicon():
            return "torch"
        if model_type is not None and not BACKENDS["mlx"].runs(model_type):
            log.warning("the MLX engine does not run %r models: using the torch engine", model_type)
            return "torch"
        reason = mlx_missing()
        if reason is None:
            return "mlx"
        log.warning("%s: using the torch engine", reason)
        return "torch"
    reason = BACKENDS[name].missing()
    if reason is not None:
        raise BackendUnavailable(reason)
    return name


def engine_for(
    model,
    tokenizer,
    state,
    precision: str,
    device: torch.device,
    kind: str = "torch",
    version: int = 0,
    aliases: dict[str, str] | None = None,
    compile: str | None = None,
) -> Engine:
    """An engine running `state` (a prepared state at `precision`) in `model`,
    a float32 model of the run's architecture (modified in place on torch).

    `aliases`: `tied_aliases(model)`, taken before the model was ever loaded
    with int8 linears (a swapped model no longer shows its ties). `compile`:
    the torch backend's (`TorchBackend`)."""
    aliases = tied_aliases(model) if aliases is None else aliases
    backend = BACKENDS[kind].build(model, state, precision, device, aliases, compile)
    return Engine(backend, tokenizer, version=version)


def refresh(engine: Engine, state, changed: Set[str] | None, version: int) -> None:
    """A newer state into `engine` in place: the `changed` keys only (None: all)."""
    engine.backend.refresh(state, changed)
    engine.version = version


def load_engine(
    path: str,
    precision: str = "int8",
    device: str = "auto",
    version: int = 0,
    engine: str = "torch",
    compile: str | None = None,
) -> Engine:
    """An engine over the model directory at `path`, at `precision`.

    `int8` and `bf16` run what a trainer would publish from these weights
    (`pulse.prepare`, the one quantizer); `fp32` runs them as they are.
    `compile`: the torch backend's (`TorchBackend`).
    """
    if precision not in RUN_PRECISIONS:
        raise ValueError(
            f"unknown precision {precision!r}; choose one of {', '.join(RUN_PRECISIONS)}"
        )
    from transformers import AutoConfig

    from .torch_backend import TorchBackend

    # The architecture is checked from config.json, before any weights load.
    kind = resolve_engine(engine, AutoConfig.from_pretrained(path).model_type)
    dev = torch.device("cpu") if BACKENDS[kind].host_only else pick_device(device)
    model, tok = load_model(path, dtype=torch.float32)
    if precision == "fp32" and kind == "torch":
        return Engine(TorchBackend(model.to(dev).eval(), compile=compile), tok, version=version)
    prepared = "exact" if precision == "fp32" else precision
    state = pulse.prepare(publishable_state(model), prepared)
    return engine_for(model, tok, state, precision, dev, kind, version, compile=compile)
