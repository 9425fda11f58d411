"""The torch backend's compiled step: `torch.compile` around two opaque operators.

On CPU, a decode step of a small model spends much of its time in
transformers' eager per-layer code around the matmuls (norms, rotary,
residuals, one dispatch per op). `CompiledStep` runs the model's forward
through inductor instead, with the two parts the compiler must not see
inside as opaque operators:

- the int8 matmul, `colonnade::int8_linear` (`model/int8.py`): its kernel
  is chosen per number of rows and keeps packed weights the compiler cannot
  lower;
- attention over the cache, `colonnade::cached_attention` (here): the cache
  is a `DynamicCache` of growing layers (`torch_backend.py`) written in
  place and sliced to a length that changes every step. As graph inputs its
  buffers would be mutated inputs aliased by their views, which inductor
  refuses, and their lengths would be sizes to guard. So the graph never
  sees the cache: the model runs without one, under an attention
  implementation registered with transformers (`IMPLEMENTATION`) whose
  operator appends the step's keys and values to the session's cache (the
  same `DynamicCache.update` as the eager path) and runs transformers' own
  SDPA attention over them.

Batch rows, block width and cache columns change from step to step: they
are marked unbacked, so one graph serves every shape (no specialization of
1-row batches or 1-token blocks, no recompiles as rows leave a batch), and
the graph always takes an explicit mask (the dense causal one where the
eager path passes none), so a padded session does not need another graph.

`TorchBackend(compile=...)`, or `COLONNADE_COMPILE` where nothing is passed:
`off` (the default) runs eagerly; `on` compiles at the first step; `auto`
compiles where a short measurement on this machine found the compiled step
faster, as the int8 kernels are chosen (`model/kernels.py`): eager and
compiled decode steps of the model itself, timed side by side at `ROWS`
rows, the choice kept in a file per CPU model, torch version and thread
count, so a machine measures each model once. A compile that fails (no C++
compiler, an architecture inductor cannot trace) falls back to the eager
step with one log line; a failing `auto` measurement is kept as `eager`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch._dynamo

from colonnade.model.int8 import compile_options
from colonnade.model.kernels import machine_key, machine_slug, read_choices, write_choices
from colonnade.model.unmerged import adapted_modules

from .layout import Block, Layout

log = logging.getLogger("colonnade.engine")

MODES = ("off", "on", "auto")
MODE_ENV = "COLONNADE_COMPILE"
CHOICES = ("compiled", "eager")
IMPLEMENTATION = "colonnade_cached"
# `auto` measures decode steps at these rows (a lone episode and a group).
ROWS = (1, 8)
PROMPT = 16  # tokens each measured row is prefilled with
STEPS = 6  # decode steps timed per round
ROUNDS = 3  # rounds, eager and compiled alternating


def inductor_options() -> dict:
    """Inductor's options for the step: the int8 operator's (`compile_options`)
    and its own kernels on one thread. Those are the norms, rotary and
    residuals of a few rows: an OpenMP region per kernel costs more than it
    saves, and on a shared machine it waits on a thread that is not running
    (the matmuls and attention, in the operators, keep torch's threads)."""
    return {**compile_options(), "cpp.threads": 1}


# The session being stepped: the operator's cache and the step's modules.
_active = threading.local()

_LIB = torch.library.Library("colonnade", "FRAGMENT")
_LIB.define(
    "cached_attention(Tensor q, Tensor k, Tensor v, Tensor mask, int layer, float scaling)"
    " -> Tensor"
)


def _cached_attention(q, k, v, mask, layer: int, scaling: float) -> torch.Tensor:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache, modules = _active.session
    keys, values = cache.dynamic.update(k, v, layer)
    out, _ = sdpa_attention_forward(modules[layer], q, keys, values, mask, scaling=scaling)
    return out.contiguous()


def _cached_attention_shape(q, k, v, mask, layer: int, scaling: float) -> torch.Tensor:
    # sdpa_attention_forward's output: [batch, queries, heads, value dim]
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], v.shape[-1]))


_LIB.impl("cached_attention", _cached_attention, "CPU")
_LIB.impl("cached_attention", torch.library.fallthrough_kernel, "Autograd")  # no gradients
torch.library.register_fake("colonnade::cached_attention", _cached_attention_shape, lib=_LIB)


def _attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface: the cached operator, for masks this
    engine built (a layer's own window is in its mask)."""
    unsupported = {k for k in ("softcap", "s_aux") if kwargs.get(k) is not None}
    if unsupported or attention_mask is None:
        raise NotImplementedError(
            f"the compiled step runs SDPA over an explicit mask, not {sorted(unsupported)}"
        )
    scale = float(scaling if scaling is not None else query.shape[-1] ** -0.5)
    out = torch.ops.colonnade.cached_attention(
        query, key, value, attention_mask, module.layer_idx, scale
    )
    return out, None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)


def mode_from(compile: str | None) -> str:
    """The compile mode: `compile` when given, else `COLONNADE_COMPILE`, else off."""
    mode = compile if compile is not None else os.environ.get(MODE_ENV) or "off"
    if mode not in MODES:
        raise ValueError(f"compile {mode!r}: choose one of {', '.join(MODES)}")
    return mode


def dense_allowed(layout: Layout, width: int) -> np.ndarray:
    """The mask [B, 1, W, columns] of a step whose block the layout gave
    without one (no row padded: plain causal attention)."""
    batch, columns = layout.real.shape
    past = columns - width
    causal = np.ones((width, columns), dtype=bool)
    causal[:, past:] = np.tril(causal[:, past:])
    return np.repeat(causal[None, None], batch, axis=0)


class CompiledStep:
    """A `TorchBackend`'s forward, compiled: `forward` takes what the
    backend's does, and returns None (logged, the cache untouched: the
    compiler runs before the graph) where the compiler fails."""

    def __init__(self, backend):
        _register_attention()
        self.backend = backend
        model = backend.model
        self.modules = {
            m.layer_idx: m
            for m in model.modules()
            if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "scaling")
        }
        # Every config a module reads its attention implementation from.
        configs = (getattr(m, "config", None) for m in model.modules())
        self.configs = list(
            {id(c): c for c in configs if hasattr(c, "_attn_implementation_internal")}.values()
        )
        self.fn = torch.compile(
            _own_code(self._forward), dynamic=True, fullgraph=True, options=inductor_options()
        )

    def _forward(self, ids, positions, mask):
        out = self.backend.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False,
            logits_to_keep=1,
        )  # fmt: skip
        return out.logits[:, -1, :]

    def forward(self, cache, block: Block, layout: Layout) -> torch.Tensor | None:
        try:
            return self._run(cache, block, layout)
        except torch._dynamo.exc.TorchDynamoException as e:
            log.warning("compiled step failed (%s): stepping eagerly", _reason(e))
            return None

    def _run(self, cache, block: Block, layout: Layout) -> torch.Tensor:
        device = self.backend.device
        allowed = block.allowed
        if allowed is None:
            allowed = dense_allowed(layout, block.ids.shape[1])
        ids = _dense(torch.from_numpy(block.ids).to(device))
        positions = _dense(torch.from_numpy(block.positions).to(device))
        mask = self.backend._mask(allowed, layout)
        mask = {k: _dense(m) for k, m in mask.items()} if isinstance(mask, dict) else _dense(mask)
        _unbacked(ids, positions, mask)
        saved = [c._attn_implementation_internal for c in self.configs]
        _active.session = (cache, self.modules)
        try:
            for c in self.configs:
                c._attn_implementation_internal = IMPLEMENTATION
            return self.fn(ids, positions, mask)
        finally:
            for c, impl in zip(self.configs, saved, strict=True):
                c._attn_implementation_internal = impl
            _active.session = None


def _own_code(method):
    """`method`, bound to its object, over a copy of its code object: dynamo
    keeps compiled graphs per code object, so every step compiled from the
    same method would pile its graphs onto one list (each a recompile of
    the last, all guards checked at every call, the list capped)."""
    fn = method.__func__
    own = types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )
    return types.MethodType(own, method.__self__)


def _reason(e: BaseException) -> str:
    """The first line of `e` and of each error behind it (dynamo wraps the
    one that stopped it), for one log line."""
    parts = []
    while e is not None and len(parts) < 4:
        first = str(e).strip().splitlines()
        parts.append(f"{type(e).__name__}: {first[0] if first else ''}")
        e = e.__cause__ or e.__context__
    return " <- ".join(parts)[:400]


def prepared_step(backend) -> CompiledStep | None:
    """The backend's compiled step where it should run (compile on, or auto
    and measured faster here) and compiles; None to step eagerly."""
    step = CompiledStep(backend)
    if backend.compile == "auto" and measured_choice(backend, step) != CHOICES[0]:
        return None
    try:
        with torch.inference_mode():
            vocab = backend.model.config.get_text_config().vocab_size
            decode_seconds(step._run, backend, 1, vocab)  # compiles, on a cache of its own
    except Exception as e:  # any failure: step eagerly
        log.warning("compiled step unavailable (%s): stepping eagerly", _reason(e))
        return None
    return step


def _dense(t: torch.Tensor) -> torch.Tensor:
    """A copy with the strides of a new tensor: the graph guards on strides,
    and numpy's views (a mask's inserted or broadcast axis) differ."""
    return t.new_empty(t.shape).copy_(t)


def _unbacked(ids: torch.Tensor, positions: torch.Tensor, mask) -> None:
    """Rows, block width and cache columns as sizes the graph never specializes on."""
    mark = torch._dynamo.decorators.mark_unbacked
    for t in (ids, positions):
        mark(t, 0)
        mark(t, 1)
    for m in mask.values() if isinstance(mask, dict) else (mask,):
        for dim in (0, 2, 3):
            mark(m, dim)


def decode_seconds(forward: Callable, backend, rows: int, vocab: int) -> float:
    """Best seconds of a decode step at `rows` rows through `forward`, after a
    prefill of `PROMPT` tokens (made-up ids; speed does not depend on them).
    The best, not the median: on a shared machine a step is only ever
    slowed by others, and the two ways are compared on what they can do."""
    layout, cache = Layout(rows), backend.new_cache(rows)
    prompt = [(7 * i + 3) % vocab for i in range(PROMPT)]
    forward(cache, layout.block([prompt] * rows, 0), layout)
    times = []
    for i in range(STEPS):
        block = layout.block([[(11 * i + 5) % vocab]] * rows, 0)
        t = time.perf_counter()
        forward(cache, block, layout)
        times.append(time.perf_counter() - t)
    return min(times)


def signature(backend) -> str:
    """What a measured choice holds for: the model's shape and precision,
    and its LoRA adapters where it runs some (small ops added to every
    step, which can move the balance between the eager and compiled step)."""
    text = backend.model.config.get_text_config()
    adapters = adapted_modules(backend.model)
    lora = ""
    if adapters:
        rank = next(iter(adapters.values())).adapter_a.shape[0]
        lora = f" lora {len(adapters)}x r{rank}"
    return (
        f"{text.model_type} {text.hidden_size}x{text.num_hidden_layers} "
        f"heads {text.num_attention_heads}/{getattr(text, 'num_key_value_heads', None)} "
        f"vocab {text.vocab_size} {backend.precision}{lora}"
    )


def choices_path() -> Path:
    """`<colonnade cache>/compile/<machine>.json`."""
    from colonnade.model.loading import cache_root

    return cache_root() / "compile" / f"{machine_slug()}.json"


_choices_lock = threading.Lock()
_timings: dict[str, dict[str, float]] = {}  # what this process measured, ms, by signature


def measured_choice(backend, step: CompiledStep) -> str:
    """`compiled` or `eager` for this backend's model on this machine: from
    the choices file, else measured now (compiling) and written there."""
    key, path = signature(backend), choices_path()
    with _choices_lock:
        known = read_choices(path, machine_key(), lambda v: v in CHOICES).get(key)
        if known is not None:
            return known
        timings = measure(backend, step)
        faster = bool(timings) and all(
            timings[f"compiled@{r}"] < timings[f"eager@{r}"] for r in ROWS
        )
        choice = CHOICES[0] if faster else CHOICES[1]
        _timings[key] = {k: round(v * 1e3, 3) for k, v in timings.items()}
        log.info("compiled step %s: %s (ms a step: %s)", key, choice, _timings[key])
        # Other processes' choices are kept, as in the kernel plan's file.
        merged = {**read_choices(path, machine_key(), lambda v: v in CHOICES), key: choice}
        write_choices(path, machine_key(), merged, {"timings_ms": _timings})
        return choice


def measure(backend, step: CompiledStep) -> dict[str, float]:
    """{"eager@rows" / "compiled@rows": best seconds of a decode step}, in
    rounds alternating the two; {} where the compiled step fails."""
    vocab = backend.model.config.get_text_config().vocab_size
    runs = {"eager": backend.eager_forward, "compiled": step._run}
    samples: dict[str, list[float]] = {f"{k}@{r}": [] for r in ROWS for k in runs}
    try:
        with torch.inference_mode():
            for rows in ROWS:
                decode_seconds(step._run, backend, rows, vocab)  # compiles
                for _ in range(ROUNDS):
                    for name, forward in runs.items():
                        samples[f"{name}@{rows}"].append(
                            decode_seconds(forward, backend, rows, vocab)
                        )
    except Exception as e:  # any failure: step eagerly here
        log.warning("compiled step unavailable (%s): stepping eagerly", _reason(e))
        return {}
    return {k: min(v) for k, v in samples.items()}
