"""LoRA adapters run unmerged in a torch model that holds published weights.

A published state may carry LoRA adapters beside its base (`model/lora.py`:
`{m}.lora_A.weight` [r, in] and `{m}.lora_B.weight` [out, r], the scale
already folded into B). `load_adapters` gives each adapted linear `m` a
forward hook that returns base(x) + (x · Aᵀ) · B'ᵀ, the adapters held as
float32 copies (non-persistent buffers `adapter_a`, `adapter_b`: they stay
out of the model's state, so the base's loaders never see them) and the
low-rank product computed in float32 whatever the base runs (int8 codes on
CPU, dequantized floats elsewhere).

Unmerged because between versions only the adapters change: a merged B'A
would rewrite every int8 row of every adapted weight each version, where
here a refresh copies the few adapter tensors a patch rewrote and the base
stays as it was. A module without adapters gets no hook, so a state without
them runs exactly as before. Sibling linears run fused (`int8.Siblings`)
keep running fused: the hook adds each member's own adapter to its slice
of the fused output.

The loader (`engine.loader.load_torch`) calls this after the base is in
place: the int8 loader replaces `nn.Linear`s by `Int8Linear`s on its first
call, and a hook on the replaced module would be lost.
"""

from __future__ import annotations

from collections.abc import Mapping, Set

import torch
from torch import nn
from torch.nn import functional as F

from .lora import adapted

A, B = "adapter_a", "adapter_b"
_HOOK = "_adapter_hook"  # the hook's handle, a plain attribute of the module


def _unmerged(module: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
    x = args[0]
    delta = F.linear(F.linear(x.to(torch.float32), module.adapter_a), module.adapter_b)
    return out + delta.to(out.dtype)


def holds_adapter(module: nn.Module) -> bool:
    return _HOOK in vars(module)


def adapted_modules(model: nn.Module) -> dict[str, nn.Module]:
    """{name: module} of the modules of `model` that run an adapter."""
    return {n: m for n, m in model.named_modules() if holds_adapter(m)}


def _attach(module: nn.Module, a: torch.Tensor, b: torch.Tensor) -> None:
    own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
    device = next((t.device for t in own if not t.is_meta), torch.device("cpu"))
    if holds_adapter(module):
        vars(module)[_HOOK].remove()
    # Normal tensors even when loaded under inference_mode: a later refresh
    # copies into them, maybe outside it, which an inference tensor refuses.
    with torch.inference_mode(False):
        a, b = (t.detach().to(device, torch.float32, copy=True) for t in (a, b))
    module.register_buffer(A, a, persistent=False)
    module.register_buffer(B, b, persistent=False)
    vars(module)[_HOOK] = module.register_forward_hook(_unmerged)


def _detach(module: nn.Module) -> None:
    vars(module).pop(_HOOK).remove()
    del module._buffers[A], module._buffers[B]


def load_adapters(
    model: nn.Module, state: Mapping[str, torch.Tensor], changed: Set[str] | None = None
) -> bool:
    """The adapters of `state` into `model`, which holds its base already:
    with `changed` (the keys a patch rewrote), only those are copied, in
    place. Modules whose adapters the state no longer has run the base
    alone again. True where the set of adapted modules or a rank changed
    (a compiled step traced before must be traced again), False where at
    most values were copied."""
    pairs = adapted(state)
    reshaped = False
    for name, module in adapted_modules(model).items():
        if name not in pairs:
            _detach(module)
            reshaped = True
    for name, (a_key, b_key) in pairs.items():
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"the state has adapters for {name}, which the model lacks") from None
        a, b = state[a_key], state[b_key]
        held = holds_adapter(module)
        if held and module.adapter_a.shape == a.shape and module.adapter_b.shape == b.shape:
            if changed is None or a_key in changed or b_key in changed:
                with torch.no_grad():
                    module.adapter_a.copy_(a)
                    module.adapter_b.copy_(b)
            continue
        _attach(module, a, b)
        reshaped = True
    return reshaped
