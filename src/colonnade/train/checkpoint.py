"""Trainer checkpoints in the store: fp32 weights, AdamW state, the cursor.

A checkpoint for version v is `trainer/checkpoints/{v}/` holding
`model.safetensors`, `optim.safetensors` and `state.json`, the last written
with put-if-absent: a checkpoint without it is ignored. Safetensors, not
torch.save: a checkpoint is data, never code.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from colonnade.protocol import keys
from colonnade.store import NotFound, ObjectStore

STATE = "state.json"


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> dict[str, torch.Tensor]:
    """AdamW's per-parameter state as named tensors (`names`: id(param) -> name)."""
    out = {}
    for group in opt.param_groups:
        for p in group["params"]:
            for k, v in opt.state.get(p, {}).items():
                t = v if torch.is_tensor(v) else torch.tensor(float(v))
                out[f"{names[id(p)]}::{k}"] = t.detach().cpu().contiguous()
    return out


def load_optimizer_tensors(opt, tensors: dict[str, torch.Tensor], params: dict[str, torch.Tensor]):
    for key, t in tensors.items():
        name, _, k = key.rpartition("::")
        if name not in params:
            raise ValueError(f"checkpoint has optimizer state for unknown parameter {name!r}")
        p = params[name]
        opt.state[p][k] = t.to(p.device) if k != "step" else t.clone()


def save_checkpoint(store: ObjectStore, version: int, model, opt, state: dict) -> None:
    params = dict(model.named_parameters())
    names = {id(p): n for n, p in params.items()}
    prefix = keys.checkpoint_dir(version)
    weights = {n: p.detach().cpu().contiguous() for n, p in params.items()}
    store.put(prefix + "model.safetensors", st_save(weights))
    store.put(prefix + "optim.safetensors", st_save(optimizer_tensors(opt, names)))
    store.put_if_absent(prefix + STATE, json.dumps({**state, "version": version}).encode())


def latest_checkpoint(store: ObjectStore) -> int | None:
    done = [k for k in store.list("trainer/checkpoints/") if k.endswith("/" + STATE)]
    return max((int(k.split("/")[2]) for k in done), default=None)


def load_checkpoint(store: ObjectStore, version: int, model, opt) -> dict:
    """Restore weights and optimizer in place; the saved state dict."""
    prefix = keys.checkpoint_dir(version)
    try:
        state = json.loads(store.get(prefix + STATE, max_bytes=1 << 20))
        weights = st_load(store.get(prefix + "model.safetensors"))
        optim = st_load(store.get(prefix + "optim.safetensors"))
    except NotFound as e:
        raise RuntimeError(f"checkpoint v{version} is incomplete: {e}") from None
    params = dict(model.named_parameters())
    missing = set(params) - set(weights)
    if missing:
        raise ValueError(f"checkpoint lacks parameters: {sorted(missing)[:3]}")
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(weights[n])
    load_optimizer_tensors(opt, optim, params)
    return state
