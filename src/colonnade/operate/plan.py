"""Sizing a run before it starts (`colonnade plan`): memory, disk and time.

What an operator provisions: memory per trainer rank, the publication's
peak on rank 0, the checkpoint and the staging folder, a worker's int8
state and memory, its decode bound, and the claim lease and timeouts that
follow. All of it comes from the model's shape and the run's settings.

`count` instantiates the model on the meta device (no weights, no memory)
and counts what the code allocates, exactly: the parameters once each (a
tied head is its embedding, as `model.int8.publishable_state` publishes
it); which tensors `pulse.prepare` publishes as int8 codes with a float32
scale per row (every 2-D float tensor, the embedding included) and which as
bf16; what a decode step streams (every linear's codes and scales, a tied
head included); the decoder layers FSDP2 shards one by one; the LoRA
targets. Everything after is arithmetic on those counts (`plan`): each
`Figure` names the code layout it rests on. The published patch sizes are
measured, not derived: `PATCH_SHARES` names where.

Who calls it: cli/plan.py, with the config `model.shapes.model_config`
finds for a name. docs/operating.md, "Sizing a run", shows the output for
the Qwen3 shapes and says what each line means.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from colonnade.choices import LORA_TARGETS
from colonnade.config import TrainerConfig
from colonnade.config.presets import TRAINER_PRESETS
from colonnade.pulse.quant import is_quantizable

# A laptop's or a base Apple M-series chip's memory bandwidth (their
# published specifications): what a worker on such a machine streams its
# weights at, at best.
DEFAULT_BANDWIDTH_GBS = 100.0
# Patch per version as a share of the int8 state, measured on SmolLM2-135M
# (docs/benchmarks.md: the PULSE table's "int8 ours" at lr 1e-6 and 1e-5,
# and "Cost per 1,000 versions" for the tiny model at the smoke rate, where a
# step rewrites about a tenth of the codes: a worst case).
PATCH_SHARES = {"lr 1e-6": 2.4e-5, "lr 1e-5": 3.3e-4, "worst": 0.116}
# The trainer's ranks time out a collective after store_outage_seconds plus
# this (train/trainer.py, `init_distributed`).
COLLECTIVE_SLACK_S = 1800.0
# How long rank 0 waits for every rank's checkpoint shards before it gives
# the checkpoint up (train/checkpoint.py, `Checkpointer.ranks_seconds`).
RANKS_WAIT_S = 3600.0
# One chunk's fp32 logits live three times over in the head's backward: the
# logits, their log-softmax and its gradient.
LOGIT_COPIES = 3

_SEARCHQA = TRAINER_PRESETS["searchqa"]


@dataclass(frozen=True)
class Counts:
    """What the sizes are made of, counted on the instantiated model."""

    architecture: str  # the model's class
    params: int  # every parameter once (a tied head is its embedding)
    tensors: int  # parameter tensors: AdamW keeps a step count for each
    quantized: int  # elements published as int8 codes (2-D float tensors)
    rows: int  # their rows: one float32 scale each
    other_bytes: int  # every other published tensor (norms, biases), bf16
    streamed: int  # int8 code elements of the linears: what a decode step reads
    streamed_rows: int  # their rows (scales)
    dense: int  # parameters outside the linears (embedding, norms): fp32 in a CPU engine
    table: int  # the input embedding's parameters (of `dense`): int8 codes in a CPU engine
    root: int  # parameters outside the decoder layers: FSDP2's root unit
    layer: int  # parameters of the largest decoder layer
    vocab: int
    tied: bool  # the head is the input embedding
    lora_targets: tuple[tuple[int, int], ...]  # (in, out) of each LoRA target linear


def count(config) -> Counts:
    """The counts of the model `config` describes, instantiated on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return counts_of(model)


def _published(model) -> list:
    """The tensors `publishable_state` gives: the state once per tensor
    (by identity: storage pointers mean nothing on the meta device)."""
    seen: set[int] = set()
    out = []
    for t in model.state_dict(keep_vars=True).values():
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out


def _decoder_layers(model) -> list:
    """The modules FSDP2 shards one by one (train/policy.py's rule)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


def counts_of(model) -> Counts:
    """The counts of an instantiated model (on any device)."""
    from torch import nn

    state = _published(model)
    quantized = [t for t in state if is_quantizable(t)]
    linears = {id(m.weight): m for m in model.modules() if isinstance(m, nn.Linear)}.values()
    params = sum(p.numel() for p in model.parameters())
    per_layer = [sum(p.numel() for p in m.parameters()) for m in _decoder_layers(model)]
    dense = sum(
        p.numel()
        for m in model.modules()
        if not isinstance(m, nn.Linear)
        for p in m.parameters(recurse=False)
    )
    head = model.get_output_embeddings()
    embed = model.get_input_embeddings()
    return Counts(
        architecture=type(model).__name__,
        params=params,
        tensors=len(list(model.parameters())),
        quantized=sum(t.numel() for t in quantized),
        rows=sum(t.shape[0] for t in quantized),
        other_bytes=sum(
            t.numel() * (2 if t.is_floating_point() else t.element_size())
            for t in state
            if not is_quantizable(t)
        ),
        streamed=sum(m.weight.numel() for m in linears),
        streamed_rows=sum(m.out_features for m in linears),
        dense=dense,
        table=embed.weight.numel(),
        root=params - sum(per_layer),
        layer=max(per_layer, default=0),
        vocab=embed.weight.shape[0],
        tied=head is not None and head.weight is embed.weight,
        lora_targets=tuple(
            (m.in_features, m.out_features)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rpartition(".")[2] in LORA_TARGETS
        ),
    )


# -- the arithmetic -------------------------------------------------------------------------


def int8_bytes(c: Counts) -> int:
    """The published int8 state: codes, float32 row scales, the rest bf16."""
    return c.quantized + 4 * c.rows + c.other_bytes


def streamed_bytes(c: Counts) -> int:
    """What one decode step reads: every linear's codes and scales."""
    return c.streamed + 4 * c.streamed_rows


def engine_bytes(c: Counts) -> int:
    """A torch CPU engine (model/int8.py): its own copy of the linears'
    codes and scales, a bf16 form of the codes where a kernel packs one
    (model/kernels.py: oneDNN's, on CPUs where it runs fastest; the bound
    assumes every linear's does), the embedding's codes (a tied head's,
    shared) and scales, every other parameter dequantized to fp32."""
    table = (0 if c.tied else c.table) + 4 * c.vocab
    return streamed_bytes(c) + 2 * c.streamed + table + 4 * (c.dense - c.table)


def lora_params(c: Counts, rank: int) -> int:
    """r × (in + out) for each target linear."""
    return rank * sum(i + o for i, o in c.lora_targets)


def per_rank(n: int, ranks: int) -> int:
    return math.ceil(n / ranks)


@dataclass(frozen=True)
class Setting:
    """The run a plan is for: the trainer's defaults and the searchqa preset's batch."""

    ranks: int = 1
    fsdp: bool = False  # FSDP2 on one process too (`--trainer.fsdp`)
    lora_rank: int = 0  # 0: full fine-tuning
    bandwidth_gbs: float = DEFAULT_BANDWIDTH_GBS
    group_size: int = _SEARCHQA["group_size"]
    groups_per_batch: int = _SEARCHQA["groups_per_batch"]
    max_episode_tokens: int = _SEARCHQA["max_episode_tokens"]
    logit_chunk_tokens: int = TrainerConfig.logit_chunk_tokens
    max_lag: int = TrainerConfig.max_lag
    spot: bool = TrainerConfig.spot_rate > 0
    keep_checkpoints: int = TrainerConfig.keep_checkpoints
    claim_seconds: float = TrainerConfig.claim_seconds
    heartbeat_timeout: float = TrainerConfig.heartbeat_timeout
    store_outage_seconds: float = TrainerConfig.store_outage_seconds
    # The demand's lease rule (train/demand.py): a worker's lease is this
    # many times its slowest recent batch, within 1x to `max_lease` x the base.
    lease_factor: float = 3.0
    max_lease: float = 20.0

    @property
    def sharded(self) -> bool:
        return self.ranks > 1 or self.fsdp

    def check(self) -> None:
        """A ValueError naming the settings no plan can be made for."""
        bad = [
            name
            for name, ok in (
                ("ranks >= 1", self.ranks >= 1),
                ("lora_rank >= 0", self.lora_rank >= 0),
                ("bandwidth_gbs > 0", self.bandwidth_gbs > 0),
                ("group_size >= 1", self.group_size >= 1),
                ("groups_per_batch >= 1", self.groups_per_batch >= 1),
                ("max_episode_tokens >= 1", self.max_episode_tokens >= 1),
                ("logit_chunk_tokens >= 1", self.logit_chunk_tokens >= 1),
            )
            if not ok
        ]
        if bad:
            raise ValueError(f"out of range: {'; '.join(bad)}")


@dataclass(frozen=True)
class Figure:
    key: str
    label: str
    value: float
    unit: str  # bytes, count, tokens, tokens/s, s, MB/s
    basis: str  # what it rests on


@dataclass
class Section:
    title: str
    figures: list[Figure] = field(default_factory=list)

    def add(self, key: str, label: str, value: float, unit: str, basis: str) -> None:
        self.figures.append(Figure(key, label, value, unit, basis))

    def total(self, key: str, label: str, basis: str) -> None:
        self.add(
            key, label, sum(f.value for f in self.figures if f.unit == "bytes"), "bytes", basis
        )


def _where(s: Setting) -> str:
    return f"{s.ranks} rank{'s' * (s.ranks > 1)}" + (", FSDP2" if s.fsdp and s.ranks == 1 else "")


def full_memory(c: Counts, s: Setting) -> Section:
    """A rank's memory for full fine-tuning, activations aside."""
    sec = Section(f"trainer memory per rank, full fine-tuning ({_where(s)})")
    shard = per_rank(c.params, s.ranks)
    sec.add(
        "masters",
        "fp32 master weights",
        4 * shard,
        "bytes",
        "fp32 master weights, sharded evenly over the ranks by FSDP2 (train/policy.py)",
    )
    sec.add("grads", "fp32 gradients", 4 * shard, "bytes", "gradients fp32, sharded likewise")
    sec.add(
        "adam",
        "AdamW moments",
        8 * shard,
        "bytes",
        "AdamW's two fp32 moments per parameter, sharded likewise",
    )
    _compute_copies(sec, c, s, grads=True)
    _logits(sec, c, s)
    sec.total("total", "total (activations aside)", _ACTIVATIONS)
    return sec


def lora_memory(c: Counts, s: Setting) -> Section:
    """A rank's memory for LoRA at `s.lora_rank`, activations aside."""
    sec = Section(f"trainer memory per rank, LoRA rank {s.lora_rank} ({_where(s)})")
    adapters = per_rank(lora_params(c, s.lora_rank), s.ranks)
    sec.add(
        "base",
        "frozen base, bf16",
        2 * per_rank(c.params, s.ranks),
        "bytes",
        "LoRA: the base frozen in bf16 (with bf16 compute; fp32 with fp32 compute), "
        "sharded like full fine-tuning's weights",
    )
    sec.add(
        "adapters",
        "fp32 adapters, gradients, AdamW",
        16 * adapters,
        "bytes",
        "adapters, their gradients and AdamW's two moments, fp32: 16 B per adapter parameter",
    )
    _compute_copies(sec, c, s, grads=False)
    _logits(sec, c, s)
    sec.total("total", "total (activations aside)", _ACTIVATIONS)
    return sec


_ACTIVATIONS = (
    "the sum of the lines above; activations come on top and follow micro_tokens and "
    "activation checkpointing"
)


def _compute_copies(sec: Section, c: Counts, s: Setting, grads: bool) -> None:
    """bf16 compute: autocast's whole copy on one process, FSDP2's gathered units sharded."""
    if not s.sharded:
        if grads:  # a LoRA base is bf16 already: autocast copies only the adapters
            sec.add(
                "compute",
                "bf16 compute copies",
                2 * c.params,
                "bytes",
                "one process without FSDP: autocast's bf16 copy of the weights for the "
                "forward (--fsdp: a layer at a time instead)",
            )
        return
    units = c.root + 2 * c.layer
    per = 6 if grads else 2
    sec.add(
        "compute",
        "bf16 compute copies",
        per * units,
        "bytes",
        "FSDP2 gathers the root unit (embeddings, head) for the whole step and two decoder "
        "layers at once (one computing, one prefetched), as bf16 params"
        + (" with fp32 gradients before the reduce-scatter" if grads else ""),
    )


def _logits(sec: Section, c: Counts, s: Setting) -> None:
    sec.add(
        "logits",
        f"logits of {s.logit_chunk_tokens} positions",
        LOGIT_COPIES * 4 * s.logit_chunk_tokens * c.vocab,
        "bytes",
        "fp32 logits of one chunk of logit_chunk_tokens row-positions over the vocabulary, "
        "three times over in the head's backward (train/policy.py)",
    )


def publication_peak(c: Counts, s: Setting) -> Section:
    """Rank 0's host memory while a version is published beside the next snapshot."""
    sec = Section("publication peak, rank 0 host memory")
    q = int8_bytes(c)
    snap = 2 * c.params + (4 * c.root if s.sharded else 0)
    sec.add(
        "snapshot",
        "snapshot of the next version",
        snap,
        "bytes",
        "full_state: the bf16 copy of the weights on the CPU; under FSDP2 each tensor is "
        "gathered in fp32 one at a time, at most the root unit's (the embedding) in flight "
        "(train/policy.py)",
    )
    sec.add(
        "publishing",
        "version being published",
        2 * c.params + 2 * q,
        "bytes",
        "the previous version's background publication while the next snapshot is taken: "
        "its bf16 snapshot, its int8 state and the int8 base it patches from "
        "(protocol/weights.py Publisher)",
    )
    if s.spot:
        held = s.max_lag * q + (s.max_lag + 1) * engine_bytes(c)
        sec.add(
            "spot",
            "spot checks",
            held,
            "bytes",
            "spot checks (spot_rate > 0) hold max_lag older int8 states and up to "
            "max_lag + 1 CPU engines, each built on a meta skeleton from its int8 state "
            "(train/spot.py)",
        )
    sec.total("total", "peak", "the sum of the lines above; the codec's working memory aside")
    return sec


def checkpoint(c: Counts, s: Setting) -> Section:
    """What DCP saves, in the store and in the staging folder."""
    sec = Section("checkpoint and staging")
    if s.lora_rank:
        a = lora_params(c, s.lora_rank)
        size = 12 * a + 4 * 2 * len(c.lora_targets)
        basis = (
            "LoRA: the fp32 adapters, AdamW's two moments and a step count per adapter "
            "tensor; the frozen base is the run's model files"
        )
    else:
        size = 12 * c.params + 4 * c.tensors
        basis = (
            "DCP saves the fp32 weights, AdamW's two moments and a step count per tensor, "
            "a tied head once (train/checkpoint.py)"
        )
    sec.add("size", "one checkpoint", size, "bytes", basis + "; shard headers aside")
    sec.add(
        "shard",
        "shard per rank",
        per_rank(size, s.ranks),
        "bytes",
        "one safetensors shard per rank, each its slices of every tensor",
    )
    sec.add(
        "store",
        f"in the store (keep_checkpoints {s.keep_checkpoints})",
        (s.keep_checkpoints + 1) * size,
        "bytes",
        "keep_checkpoints complete ones plus the one being written before the oldest is pruned",
    )
    sec.add(
        "staging",
        "trainer staging folder",
        size,
        "bytes",
        "staging_dir: each rank writes its shard there before the upload, and on resume "
        "the first process of each machine downloads every shard (a whole checkpoint)",
    )
    if not s.lora_rank:
        sec.add(
            "anchor_file",
            "rank 0 temp folder, at an anchor",
            int8_bytes(c),
            "bytes",
            "every anchor_every versions the publisher writes the int8 state to a file in the "
            "temp folder and streams it up (protocol/weights.py)",
        )
    return sec


def worker(c: Counts, s: Setting) -> Section:
    """A worker's weights: held, staged, fetched each version."""
    sec = Section("worker (torch CPU engine)")
    q = int8_bytes(c)
    sec.add(
        "int8",
        "int8 state (the anchor)",
        q,
        "bytes",
        "pulse.prepare's int8 state: every 2-D float tensor as int8 codes plus a float32 "
        "scale per row, the rest bf16; a joining worker downloads it whole",
    )
    sec.add(
        "staging",
        "staging (temp folder)",
        q,
        "bytes",
        "a joining worker downloads the anchor to a file in the temp folder, then loads "
        "it; patches are held in memory (protocol/weights.py)",
    )
    if s.lora_rank:
        sec.add(
            "adapter",
            "adapter per version (LoRA)",
            2 * lora_params(c, s.lora_rank),
            "bytes",
            "LoRA: the adapters alone, bf16, sent whole each version "
            "(an update moves every adapter weight)",
        )
    for what, share in ({} if s.lora_rank else PATCH_SHARES).items():
        sec.add(
            f"patch_{what.replace(' ', '_').replace('-', '_')}",
            f"patch per version, {what}",
            round(share * q),
            "bytes",
            "patch per version as measured shares of SmolLM2-135M's int8 state at lr 1e-6 "
            "and 1e-5, and the tiny model's at the smoke rate (docs/benchmarks.md)",
        )
    sec.add(
        "memory",
        "memory, running",
        q + engine_bytes(c),
        "bytes",
        "the follower's int8 state plus the engine: its own copy of the linears' codes "
        "and scales and a bf16 form a kernel packs of them, the embedding's int8 codes "
        "(a tied head's) and scales, the norms in fp32 (model/int8.py, model/kernels.py)",
    )
    sec.add(
        "join",
        "memory, joining",
        q + engine_bytes(c),
        "bytes",
        "while the engine is built: as running, the engine built on a meta skeleton of the "
        "run's config, its tensors made from the int8 state (protocol/model_files.py)",
    )
    return sec


def batch_seconds(c: Counts, s: Setting) -> float:
    """A batch decoded one token at a time at the bandwidth bound."""
    rate = s.bandwidth_gbs * 1e9 / streamed_bytes(c)
    return s.group_size * s.groups_per_batch * s.max_episode_tokens / rate


def timing(c: Counts, s: Setting) -> Section:
    """Decode bound, a batch's time, and the lease and timeouts that follow."""
    sec = Section(f"decode and timeouts (memory bandwidth {s.bandwidth_gbs:g} GB/s)")
    sec.add(
        "streamed",
        "weights read per token",
        streamed_bytes(c),
        "bytes",
        "a decode step at batch 1 reads every linear's int8 codes and scales once; an "
        "untied embedding is gathered, a row per token",
    )
    rate = s.bandwidth_gbs * 1e9 / streamed_bytes(c)
    sec.add(
        "tokens_per_s",
        "batch-1 decode bound",
        rate,
        "tokens/s",
        "--bandwidth-gbs over the bytes read per token: no worker at that bandwidth "
        "decodes one row faster",
    )
    tokens = s.group_size * s.groups_per_batch * s.max_episode_tokens
    sec.add(
        "batch_tokens",
        "tokens per batch",
        tokens,
        "tokens",
        f"group_size {s.group_size} x groups_per_batch {s.groups_per_batch} x "
        f"max_episode_tokens {s.max_episode_tokens}: the searchqa preset unless given",
    )
    batch = batch_seconds(c, s)
    sec.add(
        "batch_s",
        "batch time, one row at a time",
        batch,
        "s",
        "every token of the batch decoded at batch 1 at the bound: a slow worker's time "
        "(rows decoded together share the reads and go faster)",
    )
    _timeouts(sec, c, s, batch)
    return sec


def suggested_claim_seconds(batch: float, s: Setting) -> float:
    """A base lease that covers a first batch with the demand's margin, in 10 s steps."""
    return max(s.claim_seconds, 10 * math.ceil(s.lease_factor * batch / 10))


def _timeouts(sec: Section, c: Counts, s: Setting, batch: float) -> None:
    claim = suggested_claim_seconds(batch, s)
    sec.add(
        "claim_seconds",
        "claim_seconds (suggested)",
        claim,
        "s",
        f"a worker not yet measured has the base lease: {s.lease_factor:g}x the batch time "
        f"(the demand's margin on a measured worker), never below the default "
        f"{s.claim_seconds:g}; a measured worker's lease then follows its speed up to "
        f"{s.max_lease:g}x the base (train/demand.py)",
    )
    sec.add(
        "slowest_batch_s",
        "slowest batch a lease covers",
        s.max_lease * claim / s.lease_factor,
        "s",
        f"a measured worker's lease is {s.lease_factor:g}x its slowest recent batch, at "
        f"most {s.max_lease:g}x claim_seconds: a worker this slow still keeps its claims",
    )
    sec.add(
        "heartbeat_timeout",
        "heartbeat_timeout (suggested)",
        s.heartbeat_timeout,
        "s",
        "a worker heartbeats every 20 s from a thread of its own, whatever its batch time "
        "(rollout/worker.py): the default holds",
    )
    timeout = s.store_outage_seconds + COLLECTIVE_SLACK_S
    sec.add(
        "collective_timeout",
        "ranks' collective timeout",
        timeout,
        "s",
        f"store_outage_seconds ({s.store_outage_seconds:g}) plus {COLLECTIVE_SLACK_S:g}: "
        "the ranks wait this long at a collective (train/trainer.py)",
    )
    size = checkpoint(c, s).figures[0].value
    sec.add(
        "upload_mbs",
        "checkpoint upload, least rate per rank",
        per_rank(size, s.ranks) / RANKS_WAIT_S / 1e6,
        "MB/s",
        "each rank uploads its shard in the background while training goes on; rank 0 "
        f"commits the checkpoint once every shard is up, waiting at most {RANKS_WAIT_S:g} s "
        "(train/checkpoint.py): slower than this, the checkpoint is not committed",
    )
    sec.add(
        "download_mbs",
        "resume download, least rate per machine",
        size / timeout / 1e6,
        "MB/s",
        "on resume a machine's first process downloads the whole checkpoint while "
        "the other ranks wait at a barrier",
    )


def plan(c: Counts, s: Setting) -> list[Section]:
    """Every section of the plan for `c` under `s`."""
    s.check()
    if s.lora_rank:  # a LoRA run publishes its adapters: no full snapshot to size
        return [lora_memory(c, s), checkpoint(c, s), worker(c, s), timing(c, s)]
    return [full_memory(c, s), publication_peak(c, s), checkpoint(c, s), worker(c, s), timing(c, s)]


def model_facts(c: Counts, s: Setting, source: str) -> dict:
    """What the plan is of: the model, its counts, the LoRA adapters."""
    facts = {
        "source": source,
        "architecture": c.architecture,
        "params": c.params,
        "tied_head": c.tied,
        "int8_quantized_params": c.quantized,
        "int8_scales": c.rows,
    }
    if s.lora_rank:
        facts["lora_rank"] = s.lora_rank
        facts["lora_params"] = lora_params(c, s.lora_rank)
    return facts


def as_json(facts: dict, sections: list[Section], s: Setting) -> dict:
    """One JSON document: the model, the setting, every figure with its basis."""
    return {
        "model": facts,
        "setting": dataclasses.asdict(s),
        "sections": [
            {
                "title": sec.title,
                "figures": [
                    {
                        "key": f.key,
                        "label": f.label,
                        "value": _number(f),
                        "unit": f.unit,
                        "basis": f.basis,
                    }
                    for f in sec.figures
                ],
            }
            for sec in sections
        ],
    }


def _number(f: Figure) -> float | int:
    if f.unit in ("bytes", "tokens", "count"):
        return int(f.value)
    return round(f.value, 3 if f.value < 100 else 1)


def human(f: Figure) -> str:
    """A figure's value for a person: binary prefixes for bytes."""
    if f.unit == "bytes":
        v = float(f.value)
        for unit in ("B", "KiB", "MiB", "GiB"):
            if v < 1024 or unit == "GiB":
                return f"{v:,.0f} B" if unit == "B" else f"{v:,.2f} {unit}"
            v /= 1024
    if f.unit in ("tokens", "count"):
        return f"{int(f.value):,} {f.unit}"
    if f.unit == "s":
        whole = f.value >= 100 or f.value == int(f.value)
        return f"{f.value:,.0f} s" if whole else f"{f.value:,.1f} s"
    return f"{f.value:,.2f} {f.unit}" if f.value < 100 else f"{f.value:,.0f} {f.unit}"


def render(facts: dict, sections: list[Section]) -> str:
    """The plan as text: a table per section, each basis stated once below."""
    head = (
        f"{facts['architecture']} from {facts['source']}: {facts['params']:,} parameters, "
        f"{'tied' if facts['tied_head'] else 'untied'} head"
    )
    if "lora_rank" in facts:
        head += f"; LoRA rank {facts['lora_rank']}: {facts['lora_params']:,} adapter parameters"
    notes: dict[str, int] = {}
    width = max(len(f.label) for sec in sections for f in sec.figures)
    lines = [head]
    for sec in sections:
        lines += ["", sec.title]
        for f in sec.figures:
            n = notes.setdefault(f.basis, len(notes) + 1)
            lines.append(f"  {f.label:<{width}}  {human(f):>14}  [{n}]")
    lines += ["", "what each line rests on:"]
    lines += [f"  [{n}] {basis}" for basis, n in notes.items()]
    return "\n".join(lines)
