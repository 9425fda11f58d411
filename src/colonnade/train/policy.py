"""The model being trained: an HF causal LM behind one forward that returns
the log-probs of given tokens, on its device, in its precision, sharded.

    Policy(lm)(ids [B, T], mask [B, T], positions [B, T], targets [B, G])
        -> log π(targets) [B, G], the last G positions of each row

The decoder runs once; the vocabulary projection and its log-softmax run in
chunks of positions (`chunk_tokens` row-positions each), each recomputed in
backward (activation checkpointing), so fp32 logits over the whole
vocabulary exist for one chunk at a time instead of for the whole
micro-batch: with a 150k vocabulary those are the largest activations of a
step.

Precision: fp32 master weights and optimizer states always. bf16 compute is
autocast on a single device, or FSDP2's MixedPrecisionPolicy (bf16 params
in compute, fp32 gradient reduction) across ranks. FSDP2 shards every
decoder layer (the model's `_no_split_modules`) and then the root, which is
this wrapper, so the head and embeddings (tied or not) are one unit whose
parameters are gathered for the whole forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from colonnade.model import lora
from colonnade.model.logprobs import gather_logprobs
from colonnade.pulse.quant import published_value

from .distributed import Dist

PREFIX = "lm."  # the wrapped model's parameter names inside the Policy


@contextlib.contextmanager
def weights_as_published(module: nn.Module, precision: str):
    """Within: every parameter holds its published value (int8 codes × row
    scales, or bf16), as the workers run it; after: the fp32 master weights
    again. A forward and backward run within compute the gradient at the
    published point and leave it on the masters (a straight-through
    estimate), so π is the workers' policy up to staleness.

    Why: with a small rate most of an AdamW update is below the published
    precision (a weight of 0.15 moves 3e-5 a step against a bf16 half-ulp of
    5e-4), so the workers keep running close to the old policy while an fp32
    π moves; the gate then masks exactly the tokens the update pushed, and
    learning stalls (docs/benchmarks.md). Under FSDP2 the rows of
    a weight are whole in a rank's shard (dim-0 sharding), so each rank
    rounds its own.
    """
    saved = []
    if precision != "exact":
        scale = lora.scale_of(module)
        with torch.no_grad():
            for name, p in module.named_parameters():  # a tied weight comes once
                local = p.to_local() if hasattr(p, "to_local") else p.data
                saved.append((local, local.clone()))
                if name.endswith(lora.B_SUFFIX):
                    # Published as scale · B rounded (`full_state`): B here is
                    # that value over the scale, so scale · B is exactly it.
                    folded = published_value(local * scale, precision, adapter=True)
                    local.copy_(folded / scale)
                else:
                    local.copy_(published_value(local, precision, lora.is_adapter(name)))
    try:
        yield
    finally:
        with torch.no_grad():
            for local, master in saved:
                local.copy_(master)


class Policy(nn.Module):
    def __init__(self, lm: nn.Module, chunk_tokens: int = 4096, autocast_bf16: bool = False):
        super().__init__()
        self.lm = lm
        self.chunk_tokens = chunk_tokens
        self.autocast_bf16 = autocast_bf16
        cfg = lm.config
        # Heads that do more than a matmul (Gemma 2's soft cap, Cohere's and
        # Granite's logit scales) are applied here as their forward would.
        self.softcap = getattr(cfg, "final_logit_softcapping", None)
        self.logit_scale = getattr(cfg, "logit_scale", None)
        self.logits_scaling = getattr(cfg, "logits_scaling", None)
        decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else None
        self.split = decoder is not None and lm.get_output_embeddings() is not None

    def _autocast(self, device: torch.device):
        if not self.autocast_bf16:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=torch.bfloat16)

    def forward(self, ids, mask, positions, targets, temperature: float = 1.0):
        gen = targets.shape[1]
        with self._autocast(ids.device):
            if not self.split:  # an architecture without the decoder/head split
                out = self.lm(
                    input_ids=ids, attention_mask=mask, position_ids=positions,
                    logits_to_keep=gen + 1, use_cache=False,
                )  # fmt: skip
                return gather_logprobs(out.logits[:, :-1], targets, temperature)
            hidden = self.lm.get_decoder()(
                input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False
            ).last_hidden_state[:, -(gen + 1) : -1]
            step = max(1, self.chunk_tokens // max(1, ids.shape[0]))
            parts = []
            for s in range(0, gen, step):
                h, t = hidden[:, s : s + step], targets[:, s : s + step]
                if torch.is_grad_enabled() and gen > step:
                    parts.append(checkpoint(self._logp, h, t, temperature, use_reentrant=False))
                else:
                    parts.append(self._logp(h, t, temperature))
            return torch.cat(parts, dim=1)

    def _logp(self, hidden, targets, temperature: float):
        logits = self.lm.get_output_embeddings()(hidden).float()
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return gather_logprobs(logits, targets, temperature)


def as_policy(model: nn.Module) -> Policy:
    """`model` itself if it is a Policy, else a single-device fp32 Policy over it."""
    return model if isinstance(model, Policy) else Policy(model)


def _decoder_layers(lm: nn.Module) -> Iterator[nn.Module]:
    names = set(getattr(lm, "_no_split_modules", None) or ())
    for m in lm.modules():
        if type(m).__name__ in names:
            yield m


def build_policy(
    lm: nn.Module,
    where: Dist,
    bf16: bool,
    grad_ckpt: bool,
    chunk_tokens: int = 4096,
    source: str | Path | None = None,
    cpu_offload: bool = False,
    adapters: lora.LoraSpec | None = None,
    seed: int = 0,
) -> Policy:
    """The trainable Policy over `lm` (fp32, on the CPU): on `where.device`,
    sharded with FSDP2 when `where` has several ranks.

    `source`: `lm` is a skeleton (`model.skeleton`: parameters on the meta
    device) whose weights are in this model folder: it is sharded first,
    and each rank then reads only the rows it owns (`train/loading.py`).
    `cpu_offload`: FSDP2's CPUOffloadPolicy (parameters, gradients and the
    optimizer's states in host memory; a CUDA device under FSDP2 only).
    `adapters`: LoRA on a frozen base (`model/lora.py`), the adapters made
    from `seed`, the same on every rank; only they require gradients (fp32),
    and the base is kept in bf16 when the compute is."""
    if cpu_offload and (not where.sharded or where.device.type != "cuda"):
        raise ValueError("cpu_offload needs a CUDA device under FSDP2 (--fsdp or 2+ ranks)")
    if grad_ckpt:
        if hasattr(lm, "activation_checkpointing_enable"):  # transformers >= 5.2x
            lm.activation_checkpointing_enable({"use_reentrant": False})
        else:
            lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    lm.config.use_cache = False
    if adapters is not None:
        lora.attach(lm, adapters, seed)
        if bf16:
            # A frozen base needs no fp32 master: in bf16 (what the compute
            # reads anyway) the trainer's largest tensors take half.
            for p in lm.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)
    policy = Policy(lm, chunk_tokens, autocast_bf16=bf16 and not where.sharded)
    if not where.sharded:
        if source is not None:
            _fill(policy, where, source, seed)
        return policy.to(where.device)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(where.device.type, (where.world,))
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    kw = {"mesh": mesh, "mp_policy": mp}
    if cpu_offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        kw["offload_policy"] = CPUOffloadPolicy()
    for layer in list(_decoder_layers(lm)):
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)
    if source is not None:
        _fill(policy, where, source, seed)
    return policy


def _fill(policy: Policy, where: Dist, source: str | Path, seed: int) -> None:
    """Allocate a skeleton's (sharded) parameters on the rank's device and
    read this rank's rows of each from `source`; LoRA adapters made from
    `seed`."""
    from colonnade.model import tied_aliases

    from .loading import load_owned, restore_buffers, retie

    buffers = {n: b.detach().clone() for n, b in policy.named_buffers()}
    aliases = tied_aliases(policy)
    policy.to_empty(device=where.device)
    retie(policy, aliases)
    restore_buffers(policy, buffers)
    load_owned(policy, source, prefix=PREFIX)
    lora.init_adapters(policy, seed)


def full_state(
    policy: Policy, where: Dist, aliases: dict[str, str], adapters_only: bool = False
) -> dict[str, torch.Tensor]:
    """The publishable state on the CPU, a copy the next step cannot touch:
    the master weights rounded to bf16 (what every precision publishes from),
    tied copies left out, LoRA's B with its scale folded in; `adapters_only`:
    LoRA's adapters alone (the frozen base was published once). Collective
    under FSDP; empty on ranks other than 0."""
    out = {}
    scale = lora.scale_of(policy)
    for name, t in policy.state_dict().items():
        name = name.removeprefix(PREFIX)
        if name in aliases or (adapters_only and not lora.is_adapter(name)):
            continue
        # Under FSDP2 each tensor is gathered whole, one at a time, and only
        # its bf16 copy kept (rank 0): the fp32 model is never whole on a rank.
        # Every rank walks the same names in the same order (the gathers pair).
        whole = t.full_tensor() if hasattr(t, "full_tensor") else t
        if name.endswith(lora.B_SUFFIX):
            whole = whole * scale  # published folded (`model/lora.py`)
        if where.leader:
            dtype = torch.bfloat16 if whole.is_floating_point() else whole.dtype
            out[name] = whole.detach().to(device="cpu", dtype=dtype, copy=True)
        del whole
    return out
