"""Each rank reads only the rows of the weights it owns.

Loading a checkpoint whole on every rank (`from_pretrained` in fp32, then
sharding) holds the full model on the host once per rank: 8 ranks of an 8B
model need 8 × 32 GB before the first step. Instead each rank builds the
model's skeleton on the meta device (`model.skeleton`: buffers real,
parameters shapes only), FSDP2 shards it (`policy.build_policy`), the shards
are allocated empty on the rank's device, and each one is filled from the
safetensors files by reading the slice of rows the rank owns
one tensor at a time: a shard's rows are contiguous in the file (FSDP2
shards dim 0), so they are read with `readinto` straight into the shard
where the dtypes agree, through one slice-sized buffer where they do not.
Not through safetensors' memory map: the file pages a rank touched would
count in its resident memory until the file closes. A rank's peak is its
shard plus the largest slice in flight.

Tied weights (a head sharing the embedding) are one parameter, listed once:
whichever of their names the files hold fills it. A parameter no file holds
is an error, not a random init.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import torch
from torch import nn

from colonnade.pulse.quant import is_adapter

# safetensors dtype names -> torch dtypes (the ones a model's weights use)
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER = 100 << 20  # bytes of a safetensors header we read


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


def header(path: Path) -> tuple[dict, int]:
    """(the safetensors header: name -> {dtype, shape, data_offsets}, where the data begins)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n > MAX_HEADER:
            raise ValueError(f"{path.name}: a safetensors header of {n} bytes")
        head = json.loads(f.read(n))
    head.pop("__metadata__", None)
    return head, 8 + n


def read_rows(f, info: dict, start: int, rows: tuple[slice, ...], out: torch.Tensor) -> int:
    """Read the rows `rows[0]` of one tensor (described by `info`, its data at
    `start` in the open file `f`) into `out`; the bytes read."""
    dtype, shape = _DTYPES[info["dtype"]], info["shape"]
    row = dtype.itemsize
    for n in shape[1:]:
        row *= n
    first, stop = (rows[0].start, rows[0].stop) if shape else (0, 1)
    f.seek(start + info["data_offsets"][0] + first * row)
    size = (stop - first) * row
    target = (
        out if out.dtype == dtype and out.is_contiguous() else torch.empty(out.shape, dtype=dtype)
    )
    if size and f.readinto(memoryview(target.view(torch.uint8).numpy()).cast("B")) != size:
        raise ValueError(f"{getattr(f, 'name', 'file')}: short read")
    if target is not out:
        out.copy_(target)
    return size


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


def retie(module: nn.Module, aliases: dict[str, str]) -> None:
    """Make tied parameters one again (`aliases`: `model.tied_aliases`, taken
    before `to_empty`, which gives every module its own copy of a shared one)."""
    params = {name for name, _ in module.named_parameters(remove_duplicate=False)}
    for name, first in aliases.items():
        if name not in params:
            continue  # a buffer sharing storage: to_empty's copy is restored as a buffer
        shared = module.get_parameter(first)
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        if getattr(holder, attr) is not shared:
            setattr(holder, attr, shared)


def load_owned(module: nn.Module, model_dir: str | Path, prefix: str = "") -> int:
    """Fill `module`'s (sharded) parameters from `model_dir`'s safetensors,
    each rank reading only its own rows; `prefix`: the checkpoint's names
    sit under it in `module`. LoRA adapters are left as they are (the
    trainer initialises them). The bytes this rank read."""
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
        head, start = header(path)
        with open(path, "rb", buffering=0) as f:
            for key, info in head.items():
                name = answers.get(prefix + key)
                if name is None or name in filled:
                    continue  # not a parameter (a buffer saved), or a tied copy
                param = params[name]
                if tuple(info["shape"]) != tuple(param.shape) or info["dtype"] not in _DTYPES:
                    raise ValueError(
                        f"{path.name}: {key} is {info['dtype']} {info['shape']}, "
                        f"the model's is {tuple(param.shape)}"
                    )
                rows = owned_rows(param)
                if any(s != slice(0, n) for s, n in zip(rows[1:], param.shape[1:], strict=True)):
                    raise ValueError(f"{key}: a shard that is not whole rows")
                local = param.to_local() if hasattr(param, "to_local") else param.data
                with torch.no_grad():
                    read += read_rows(f, info, start, rows, local)
                filled.add(name)
    # LoRA adapters are not in a model's files: the trainer makes them.
    missing = sorted(n for n in set(params) - filled if not is_adapter(n))
    if missing:
        shown = ", ".join(n.removeprefix(prefix) for n in missing[:5])
        raise ValueError(f"{model_dir}: no weights for {len(missing)} parameter(s): {shown}")
    return read
