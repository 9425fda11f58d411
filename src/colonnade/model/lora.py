"""LoRA: low-rank adapters on a frozen base, named the way PEFT names them.

A target linear `m` gains two bias-free children, `m.lora_A` (in → r) and
`m.lora_B` (r → out), and returns base(x) + scale · B(A(x)), scale = alpha
/ r. The trainer trains A and B alone. What it publishes is A and scale ·
B (the scale folded in by `train.policy.full_state`), in bf16 beside the
int8 base: a worker runs base(x) + B'(A(x)) with no LoRA settings of its
own, and the update a version makes is the low-rank ΔW = B'A, which only
the adapters' patch carries. Engines keep the adapters unmerged: merged
into the base they would change every int8 row, every version.

Tensor names: `{module}.lora_A.weight` [r, in] and `{module}.lora_B.weight`
[out, r], as in PEFT's `adapter_model.safetensors` without its
`base_model.model.` prefix and adapter name.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from colonnade.choices import LORA_TARGETS
from colonnade.pulse.quant import is_adapter

TARGETS = LORA_TARGETS
A_SUFFIX, B_SUFFIX = ".lora_A.weight", ".lora_B.weight"

__all__ = ["TARGETS", "LoraSpec", "is_adapter"]


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: tuple[str, ...] = TARGETS

    def __post_init__(self):
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, not {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be > 0, not {self.alpha}")
        if not self.targets:
            raise ValueError("LoRA needs at least one target module name")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


def _hook(module: nn.Module, args, out):
    delta = module.lora_B(module.lora_A(args[0].to(module.lora_A.weight.dtype)))
    return out + (delta * module.lora_scale).to(out.dtype)


def targets_in(model: nn.Module, targets: Iterable[str]) -> list[str]:
    """Names of the linears of `model` whose last name part is a target."""
    wanted = set(targets)
    return [
        name
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] in wanted
    ]


def attach(model: nn.Module, spec: LoraSpec, seed: int = 0) -> list[str]:
    """Freeze every parameter of `model` and give each target linear its
    adapters (A like PEFT's default init, B zero: the model's output is
    unchanged until a step moves B); the adapted modules' names. On a
    skeleton (meta parameters) the adapters are meta too: `init_adapters`
    makes them once the base is real."""
    names = targets_in(model, spec.targets)
    if not names:
        raise ValueError(
            f"no linear named {', '.join(spec.targets)} in the model: "
            "choose LoRA target modules it has"
        )
    for p in model.parameters():
        p.requires_grad_(False)
    for name in names:
        m = model.get_submodule(name)
        w = m.weight
        m.lora_A = nn.Linear(m.in_features, spec.rank, bias=False, device=w.device, dtype=w.dtype)
        m.lora_B = nn.Linear(spec.rank, m.out_features, bias=False, device=w.device, dtype=w.dtype)
        m.lora_scale = spec.scale
        m.register_forward_hook(_hook)
    if not any(p.is_meta for p in model.parameters()):
        init_adapters(model, seed)
    return names


def init_adapters(model: nn.Module, seed: int) -> None:
    """A kaiming-uniform (a = √5, as PEFT and nn.Linear), B zero, from
    `seed`: every rank and every run from the same seed starts equal. Made
    where they are meta."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, m in sorted(model.named_modules(), key=lambda x: x[0]):
            if not hasattr(m, "lora_A"):
                continue
            a, b = m.lora_A, m.lora_B
            fan_in = a.in_features
            bound = math.sqrt(6.0 / ((1 + 5.0) * fan_in))  # kaiming_uniform_(a=√5)
            value = torch.empty(a.weight.shape).uniform_(-bound, bound, generator=gen)
            for layer, made in ((a, value), (b, torch.zeros(b.weight.shape))):
                w = layer.weight
                if w.is_meta:
                    dev = m.weight.device if not m.weight.is_meta else torch.device("cpu")
                    layer.weight = nn.Parameter(made.to(dev, m.weight.dtype))
                elif hasattr(w, "device_mesh"):  # a DTensor: this rank's rows
                    from torch.distributed.tensor import distribute_tensor

                    # Every rank made the same tensor: no scatter needed.
                    full = distribute_tensor(
                        made.to(w.dtype), w.device_mesh, w.placements, src_data_rank=None
                    )
                    w.to_local().copy_(full.to_local())
                else:
                    w.copy_(made)


def scale_of(model: nn.Module) -> float | None:
    """The scale of `model`'s adapters, None where it has none."""
    for m in model.modules():
        if hasattr(m, "lora_scale"):
            return float(m.lora_scale)
    return None


def adapted(state: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, str]]:
    """{module name: (A's key, B's key)} of the adapters in a (published)
    state; ValueError where one of a pair is missing or the shapes do not
    chain."""
    out: dict[str, tuple[str, str]] = {}
    for key in state:
        if key.endswith(A_SUFFIX):
            module = key[: -len(A_SUFFIX)]
            b = module + B_SUFFIX
            if b not in state:
                raise ValueError(f"{key} has no {b}")
            if state[key].shape[0] != state[b].shape[1]:
                raise ValueError(
                    f"{module}: adapter shapes {tuple(state[key].shape)} and "
                    f"{tuple(state[b].shape)} do not chain"
                )
            out[module] = (key, b)
        elif key.endswith(B_SUFFIX) and key[: -len(B_SUFFIX)] + A_SUFFIX not in state:
            raise ValueError(f"{key} has no {key[: -len(B_SUFFIX)] + A_SUFFIX}")
    return out


def merge(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A float state with folded adapters as a plain model's: each adapted
    weight W + B'A (in W's dtype, computed in fp32), the adapters gone."""
    pairs = adapted(state)
    out = {k: v for k, v in state.items() if not is_adapter(k)}
    for module, (a, b) in pairs.items():
        w = out[f"{module}.weight"]
        delta = state[b].to(torch.float32) @ state[a].to(torch.float32)
        out[f"{module}.weight"] = (w.to(torch.float32) + delta).to(w.dtype)
    return out


def rank_of(state: Mapping[str, torch.Tensor]) -> int | None:
    """The adapters' rank in a state, None where it has none."""
    pairs = adapted(state)
    return int(state[next(iter(pairs.values()))[0]].shape[0]) if pairs else None
