"""The MLX rollout engine: the episode loop of `Engine` over an MLX forward pass.

Sampling, stop strings, turns and the recorded behaviour log-probs are the
torch engine's own code (`Engine.generate`, `sampling.sample` on the logits
MLX returns), so both engines write the same episode records; only the
forward pass and its KV cache (`_MlxSession`) are MLX.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from colonnade.model.mlx_llama import MlxLlama

from .engine import Engine, Layout


class _MlxSession:
    def __init__(self, engine: MlxEngine, batch: int):
        import mlx.core as mx

        self.mx, self.engine = mx, engine
        self.layout = Layout(batch, torch.device("cpu"))
        self.cache: list = [None] * engine.model.shape.layers

    def step(self, chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        mx = self.mx
        ids, positions, mask = self.layout.block(chunks, self.engine.pad_id)
        if mask is not None:
            mask = mx.array(mask.numpy())
        elif ids.shape[1] > 1:  # no padding: causal, last query aligned with the last key
            mask = "causal"
        logits = self.engine.model(
            mx.array(ids.numpy()), mx.array(positions.numpy()), mask, self.cache
        )
        # MLX is lazy: evaluating the cache with the logits keeps each step's
        # graph from growing into the next one.
        mx.eval(logits, *[a for kv in self.cache for a in kv])
        return torch.from_numpy(np.array(logits.astype(mx.float32)))

    def keep(self, rows: list[int]) -> None:
        index = self.mx.array(self.layout.keep(rows).numpy())
        drop = self.layout.trim()
        self.cache = [(k[index, :, drop:], v[index, :, drop:]) for k, v in self.cache]

    def extend(self, other: _MlxSession) -> None:
        pad_a, pad_b = self.layout.extend(other.layout)
        mx = self.mx

        def left(a, columns: int):
            return mx.pad(a, [(0, 0), (0, 0), (columns, 0), (0, 0)]) if columns else a

        self.cache = [
            (
                mx.concatenate([left(k, pad_a), left(k2, pad_b)]),
                mx.concatenate([left(v, pad_a), left(v2, pad_b)]),
            )
            for (k, v), (k2, v2) in zip(self.cache, other.cache, strict=True)
        ]


class MlxEngine(Engine):
    """Runs an `MlxLlama` over batches of multi-turn episodes (sampling on CPU)."""

    name = "mlx"

    def __init__(self, model: MlxLlama, tokenizer, version: int = 0):
        self._bind(model, tokenizer, version)
        self.device = torch.device("cpu")  # where the sampled ids live

    @classmethod
    def from_state(cls, skeleton, tokenizer, state, precision: str, version: int = 0):
        """An engine over `state` (int8 codes or float) named as `skeleton`'s tensors."""
        from colonnade.model import tied_aliases

        model = MlxLlama(skeleton, tied_aliases(skeleton), precision)
        model.load(state)
        return cls(model, tokenizer, version=version)

    def _session(self, batch: int) -> _MlxSession:
        return _MlxSession(self, batch)
