"""The rollout engine: batched multi-turn episodes over a pluggable backend.

Layout of the package, bottom up:

- `sampling.py`: the next token and the log-prob the trainer's gate needs;
- `layout.py`: which cache columns are real tokens (pads sit anywhere in a
  row once tool replies of different lengths join), the step's `Block`;
- `backend.py`: what a backend provides, `Backend` (forward, refresh, new
  caches) and `Cache` (rows cut, copied, written, joined, compacted), with
  the contract a new backend must meet;
- `session.py`: one running batch, its layout and its cache cut together;
- `loop.py`: `Engine`, the backend-free episode loop (turns, stop strings,
  refill from waiting groups, shared prefills, tool replies, records);
- `torch_backend.py`, `mlx_backend.py`: one module per backend;
- `stages.py`: a model cut into pipeline stages (a stage's layers, its
  tensors, its cache), composed in one process as a backend;
- `loader.py`: `BACKENDS`, the one list of backends, and the one way a
  published state becomes an engine (`engine_for`, `load_engine`).

A published state that carries LoRA adapters runs them unmerged beside its
base on every backend (torch: `model/unmerged.py`; MLX: mlx-lm's
`LoRALinear`); a patch of the adapters alone refreshes only them.

Adding a backend (vLLM, llama.cpp, a pipeline stage): write its `Backend`
and `Cache` in one module, add it to `loader.BACKENDS`, and add it to the
backend suite in `tests/engine/test_backends.py`.
"""

from .backend import Backend, BackendUnavailable, Cache, UnsupportedArchitecture
from .loader import BACKENDS, engine_for, load_engine, refresh, resolve_engine
from .loop import Engine, Episode, Responder
from .sampling import SamplingParams, filtered_logprobs, sample

__all__ = [
    "BACKENDS",
    "Backend",
    "BackendUnavailable",
    "Cache",
    "Engine",
    "Episode",
    "Responder",
    "SamplingParams",
    "UnsupportedArchitecture",
    "engine_for",
    "filtered_logprobs",
    "load_engine",
    "refresh",
    "resolve_engine",
    "sample",
]
