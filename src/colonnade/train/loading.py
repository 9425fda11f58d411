"""Each rank reads only the rows of the weights it owns.

Loading a checkpoint whole on every rank (`from_pretrained` in fp32, then
sharding) holds the full model on the host once per rank: 8 ranks of an 8B
model need 8 × 32 GB before the first step. Instead each rank builds the
model's skeleton on the meta device (`model.skeleton`: buffers real,
parameters shapes only), FSDP2 shards it (`policy.build_policy`), the shards
are allocated empty on the rank's device, and each one is filled from the
safetensors files by reading the slice of rows the rank owns
(`safe_open(...).get_slice`), one tensor at a time. A rank's peak is its
shard plus the largest slice in flight.

Tied weights (a head sharing the embedding) are one parameter, listed once:
whichever of their names the files hold fills it. A parameter no file holds
is an error, not a random init.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn


def weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files of a model folder: the index's, or the one file."""
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [root / n for n in names]
    single = root / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(f"{root}: no model.safetensors (nor an index of shards)")
    return [single]


def owned_rows(param: torch.Tensor) -> tuple[slice, ...]:
    """The index of the global tensor that this rank's shard of `param` holds
    (the whole tensor for a parameter that is not a DTensor)."""
    if not hasattr(param, "device_mesh"):
        return tuple(slice(0, n) for n in param.shape)
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))


def restore_buffers(module: nn.Module, buffers: dict[str, torch.Tensor]) -> None:
    """Put back buffers that `to_empty` left uninitialised (rotary tables)."""
    own = dict(module.named_buffers())
    with torch.no_grad():
        for name, value in buffers.items():
            own[name].copy_(value)


def tied_groups(module: nn.Module) -> list[list[str]]:
    """Names of each parameter that several modules share (tied embeddings)."""
    names: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [group for group in names.values() if len(group) > 1]


def retie(module: nn.Module, groups: list[list[str]]) -> None:
    """Make each group's parameters one again (`to_empty` gives every module
    its own copy of a shared parameter)."""
    for first, *others in groups:
        shared = module.get_parameter(first)
        for name in others:
            owner, _, attr = name.rpartition(".")
            holder = module.get_submodule(owner) if owner else module
            if getattr(holder, attr) is not shared:
                setattr(holder, attr, shared)


def load_owned(module: nn.Module, model_dir: str | Path, prefix: str = "") -> int:
    """Fill `module`'s (sharded) parameters from `model_dir`'s safetensors,
    each rank reading only its own rows; `prefix`: the checkpoint's names
    sit under it in `module`. The bytes this rank read."""
    from safetensors import safe_open

    params = dict(module.named_parameters())  # a tied parameter once, under one name
    by_tensor = {id(p): name for name, p in params.items()}
    # every name a parameter answers to (tied ones have several)
    answers = {
        name: by_tensor[id(p)]
        for name, p in module.named_parameters(remove_duplicate=False)
        if id(p) in by_tensor
    }
    filled: set[str] = set()
    read = 0
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                name = answers.get(prefix + key)
                if name is None or name in filled:
                    continue  # not a parameter (a buffer saved), or a tied copy
                param = params[name]
                if tuple(f.get_slice(key).get_shape()) != tuple(param.shape):
                    raise ValueError(
                        f"{path.name}: {key} has shape {f.get_slice(key).get_shape()}, "
                        f"the model's is {tuple(param.shape)}"
                    )
                rows = owned_rows(param)
                part = f.get_slice(key)[rows]
                local = param.to_local() if hasattr(param, "to_local") else param.data
                with torch.no_grad():
                    local.copy_(part.to(dtype=local.dtype))
                read += part.numel() * part.element_size()
                filled.add(name)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(n.removeprefix(prefix) for n in missing[:5])
        raise ValueError(f"{model_dir}: no weights for {len(missing)} parameter(s): {shown}")
    return read
