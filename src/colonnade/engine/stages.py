"""A model cut into pipeline stages: each runs a contiguous slice of the layers.

A model too big for one worker runs as N stage-workers in a line. Stage K
holds layers [start, stop) and their KV cache only; the first stage also
embeds the token ids, the last also holds the final norm and the head and
turns its last column into next-token logits. Between stages travel the
hidden states of every column of the step ([B, W, hidden]), in float32
(`WIRE`).

What lives here, bottom up:

- `plan_stages`: where the cuts fall, balancing each stage's weights (the
  head counts as the matrix it is: on a decode step a stage's time is its
  weights streamed once) so no stage holds up the line;
- `StageNames`: which tensors of a published state a stage holds, and their
  names in the stage's own model (its layers numbered from 0), so a stage
  loads, and follows patches of, its own tensors only;
- `build_stage`: a stage's model from the run's config, its parameters made
  from its tensors alone (a skeleton, as `model.loading.skeleton`);
- `StageBackend`: the torch backend over one stage's model: the same
  transformers decoder forward, masks and cache as `TorchBackend`, over the
  stage's layers, taking ids (first) or hidden states (the others);
- `ChainBackend`: stages composed in one process behind the ordinary
  `Backend` contract (every cache cut applied to every stage's cache, the
  activations rounded to the wire dtype between stages). It is how a
  pipeline is checked against the whole model, and the reference a
  pipeline across processes must reproduce.

Every stage runs the decoder's own forward on the same block and mask, so
with float32 on the wire a chain computes exactly what the whole model
does; bf16 on the wire would round the residual stream once per cut.
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Mapping, Sequence, Set
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from colonnade.config.worker import parse_stage as parse_stage  # the settings read it
from colonnade.model import tied_aliases
from colonnade.model.int8 import held_codes
from colonnade.model.loading import params_on_meta
from colonnade.pulse.quant import SCALE_SUFFIX

from .backend import UnsupportedArchitecture
from .layout import Block, Layout
from .torch_backend import TorchBackend, TorchCache

# The activations' dtype between stages. Not bf16, though the int8 linears
# round their inputs to it: the residual stream of real models carries
# outlier channels, and rounding it at a cut moves log-probs well past what
# the trainer's gate tolerates (docs/benchmarks.md). A decode step sends one
# column a row, so float32 costs little on the wire.
WIRE = torch.float32
WIRE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# A decoder layer's tensors, as every causal LM transformers runs names them.
_LAYER = re.compile(r"^(?P<head>(?:.*\.)?layers\.)(?P<index>\d+)(?P<rest>\..+)$")


@dataclass(frozen=True)
class Stage:
    """Stage `index` (0-based) of `count`: layers [start, stop)."""

    index: int
    count: int
    start: int
    stop: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> int:
        return self.stop - self.start


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), nn.ModuleList):
        raise UnsupportedArchitecture(
            "pipeline stages run decoder-only causal LMs (model.layers), "
            f"not {type(model).__name__}"
        )
    return inner


def _numel(module: nn.Module | None) -> int:
    return sum(p.numel() for p in module.parameters()) if module is not None else 0


def plan_stages(model: nn.Module, count: int) -> list[Stage]:
    """The cuts of `model` (a skeleton will do) into `count` stages of
    contiguous layers, minimizing the largest stage's weights (layers, and
    the head on the last stage; an embedding is gathered, not streamed)."""
    layers = _decoder(model).layers
    if not 1 <= count <= len(layers):
        raise ValueError(f"{count} stages of a model of {len(layers)} layers")
    cost = [float(_numel(layer)) for layer in layers]
    head = float(_numel(model.get_output_embeddings()))
    prefix = np.concatenate([[0.0], np.cumsum(cost)])
    n = len(layers)
    # best[s][j]: the least largest stage cost of layers [0, j) in s stages.
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(count + 1)]
    cut = [[0] * (n + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for s in range(1, count + 1):
        for j in range(s, n + 1):
            extra = head if (s == count and j == n) else 0.0
            for i in range(s - 1, j):
                worst = max(best[s - 1][i], prefix[j] - prefix[i] + extra)
                if worst < best[s][j]:
                    best[s][j], cut[s][j] = worst, i
    bounds, j = [], n
    for s in range(count, 0, -1):
        i = cut[s][j]
        bounds.append((i, j))
        j = i
    return [Stage(k, count, a, b) for k, (a, b) in enumerate(reversed(bounds))]


class StageNames:
    """A stage's tensors in a published state: which, and their local names.

    A layer's tensors (its scales and adapters too) are renamed to the
    stage's own numbering; the others (embedding, final norm, head) keep
    their names and belong to the stages whose model holds them, through
    `aliases` (a tied head is its embedding's codes).
    """

    def __init__(self, stage: Stage, held: Set[str]):
        self.stage = stage
        self.held = frozenset(held)  # non-layer tensors the stage's model holds

    def local(self, name: str) -> str | None:
        """`name`'s name in the stage's model, or None if the stage does not hold it."""
        m = _LAYER.match(name)
        if m:
            i = int(m["index"])
            if not self.stage.start <= i < self.stage.stop:
                return None
            return f"{m['head']}{i - self.stage.start}{m['rest']}"
        return name if name.removesuffix(SCALE_SUFFIX) in self.held else None

    def select(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The stage's tensors of `state`, under their local names."""
        out = {}
        for name, value in state.items():
            mine = self.local(name)
            if mine is not None:
                out[mine] = value
        return out

    def changed(self, keys: Set[str] | None) -> set[str] | None:
        """A patch's changed keys, as the stage's own (None stays None: all)."""
        if keys is None:
            return None
        return {m for k in keys if (m := self.local(k)) is not None}


def _stage_config(config, stage: Stage):
    config = copy.deepcopy(config)
    config.num_hidden_layers = stage.layers
    kinds = getattr(config, "layer_types", None)
    if kinds is not None:
        config.layer_types = list(kinds)[stage.start : stage.stop]
    return config


def stage_skeleton(config, stage: Stage) -> tuple[nn.Module, dict[str, str]]:
    """(the stage's model with parameters on the meta device, its tied
    aliases): `stage.layers` layers, the embedding on the first stage, the
    final norm and the head on the last."""
    from transformers import AutoModelForCausalLM

    with params_on_meta():
        model = AutoModelForCausalLM.from_config(_stage_config(config, stage), dtype=torch.float32)
    model.eval()
    aliases = tied_aliases(model)
    inner = _decoder(model)
    if not stage.first:
        inner.embed_tokens = None  # later stages take hidden states
    if not stage.last:
        inner.norm = nn.Identity()  # the final norm is the last stage's
        model.lm_head = None
        aliases = {k: v for k, v in aliases.items() if not k.startswith("lm_head.")}
    return model, aliases


def stage_names(model: nn.Module, aliases: Mapping[str, str], stage: Stage) -> StageNames:
    """The published tensors a stage's model (`stage_skeleton`) holds."""
    held = {aliases.get(n, n) for n in model.state_dict() if not _LAYER.match(n)}
    return StageNames(stage, held)


class StageBackend(TorchBackend):
    """One stage of a model: the decoder's forward over its layers.

    `run` takes this step's block and, after the first stage, the previous
    stage's hidden states [B, W, hidden]; it returns the hidden states of
    every column, or on the last stage the next-token logits [B, V] of each
    row's last column (what `TorchBackend.forward` returns). Steps run
    eagerly: the compiled step is the whole model's.
    """

    def __init__(self, model, stage: Stage, names: StageNames, precision: str, aliases):
        super().__init__(model, precision, aliases, compile="off")
        self.stage, self.names = stage, names
        self.decoder = _decoder(model)
        params = inspect.signature(self.decoder.forward).parameters
        self.decoder_cache_arg = "cache" if "cache" in params else "past_key_values"
        self.softcap = getattr(model.config.get_text_config(), "final_logit_softcapping", None)

    def run(
        self, cache: TorchCache, block: Block, layout: Layout, hidden: torch.Tensor | None = None
    ) -> torch.Tensor:
        if self.stage.first:
            inputs = {"input_ids": torch.from_numpy(block.ids).to(self.device)}
        else:
            if hidden is None:
                raise ValueError("a later stage takes the previous stage's hidden states")
            inputs = {"inputs_embeds": hidden.to(self.device, torch.float32)}
        out = self.decoder(
            **inputs,
            attention_mask=self._mask(block.allowed, layout),
            position_ids=torch.from_numpy(block.positions).to(self.device),
            **{self.decoder_cache_arg: cache.dynamic},
            use_cache=True,
        ).last_hidden_state
        if not self.stage.last:
            return out
        logits = self.model.lm_head(out[:, -1:, :])[:, -1, :]
        if self.softcap is not None:  # as the causal LM's own forward caps them
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, cache: TorchCache, block: Block, layout: Layout) -> torch.Tensor:
        if not (self.stage.first and self.stage.last):
            raise ValueError("a stage of several runs through `run`, not `forward`")
        return self.run(cache, block, layout)

    def refresh(self, state, changed: Set[str] | None) -> None:
        """A newer published state (every stage's tensors): this stage's only."""
        super().refresh(self.names.select(state), self.names.changed(changed))

    def held(self, published: Set[str]) -> dict[str, torch.Tensor]:
        """{published name: the int8 codes this stage runs} for the names of
        `published` it holds: what a follower keeps in place of its own
        copies, so the stage holds its codes once (a stacked sibling's are
        views into its set's)."""
        local = held_codes(self.model, self.aliases)
        out = {}
        for name in published:
            mine = self.names.local(name)
            if mine is not None and mine in local:
                out[name] = local[mine]
        return out


def build_stage(
    config,
    state: Mapping[str, torch.Tensor],
    stage: Stage,
    precision: str = "int8",
    device: torch.device | None = None,
    share: bool = False,
) -> StageBackend:
    """A stage's backend from the run's model config and a published state
    (every stage's tensors, or this stage's alone): only its tensors are
    made. `share`: its int8 layers run the state's codes themselves, for a
    state its holder never rewrites in place (`StageBackend.held`)."""
    from .loader import load_torch

    device = device or torch.device("cpu")
    model, aliases = stage_skeleton(config, stage)
    names = stage_names(model, aliases, stage)
    mine = names.select(state)
    load_torch(model, mine, aliases, precision, device, share=share)
    missing = [n for n, t in model.state_dict().items() if t.is_meta]
    if missing:
        raise ValueError(f"stage {stage.index + 1}/{stage.count}: no tensor for {missing[:3]}")
    return StageBackend(model.to(device).eval(), stage, names, precision, aliases)


class ChainCache:
    """`backend.Cache` of a chain: one cache per stage, every cut applied to each."""

    def __init__(self, caches: Sequence[TorchCache]):
        self.caches = list(caches)

    @property
    def empty(self) -> bool:
        return self.caches[0].empty

    def rows(self, index: np.ndarray, drop: int) -> ChainCache:
        return ChainCache([c.rows(index, drop) for c in self.caches])

    def select(self, index: np.ndarray, drop: int) -> None:
        for c in self.caches:
            c.select(index, drop)

    def write(self, slots: np.ndarray, other: ChainCache, start: int) -> None:
        for c, o in zip(self.caches, other.caches, strict=True):
            c.write(slots, o, start)

    def append(self, rows: np.ndarray, other: ChainCache, width: int) -> None:
        for c, o in zip(self.caches, other.caches, strict=True):
            c.append(rows, o, width)

    def join(self, other: ChainCache, pad_self: int, pad_other: int) -> None:
        for c, o in zip(self.caches, other.caches, strict=True):
            c.join(o, pad_self, pad_other)

    def stack(self, others: list[ChainCache], pads: list[int]) -> None:
        for k, c in enumerate(self.caches):
            c.stack([o.caches[k] for o in others], pads)

    def gather(self, index: np.ndarray) -> None:
        for c in self.caches:
            c.gather(index)


class ChainBackend:
    """`backend.Backend` over stages in one process, activations rounded to
    `wire` between them, as they would travel between stage-workers."""

    name = "torch"

    def __init__(self, stages: Sequence[StageBackend], wire: torch.dtype = WIRE):
        if [s.stage.index for s in stages] != list(range(len(stages))):
            raise ValueError("a chain takes every stage, in order")
        self.stages, self.wire = list(stages), wire

    def new_cache(self, batch: int) -> ChainCache:
        return ChainCache([s.new_cache(batch) for s in self.stages])

    def forward(self, cache: ChainCache, block: Block, layout: Layout) -> torch.Tensor:
        hidden = None
        for stage, part in zip(self.stages, cache.caches, strict=True):
            out = stage.run(part, block, layout, hidden)
            hidden = out.to(self.wire)
        return out

    def refresh(self, state, changed: Set[str] | None) -> None:
        for s in self.stages:
            s.refresh(state, changed)
