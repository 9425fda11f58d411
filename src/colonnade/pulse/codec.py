"""PULSE patches: encode the change between two states, apply it back exactly.

A state is a dict of tensors (safetensors names, dtypes and shapes). A patch
lists, per tensor that changed, the positions of the changed elements and a
residual that rebuilds their new bits exactly (an XOR with the old bits, or
the difference of order-preserving integer keys: both exact, never a float
difference). New tensors, and tensors whose dtype or shape changed, travel
whole; dropped tensors are listed. The header carries the state hashes of
the base and of the result (`hashing`: BLAKE3 tree hashes by default), and
`apply` checks both, so a wrong state is never returned. See
docs/pulse-format.md for the byte layout.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from . import parallel, positions, residuals, torch_pass
from .context import choose_context, class_map
from .format import POSITION_BLOCKS, pack
from .hashing import DEFAULT as DEFAULT_HASH
from .hashing import leaf_hash, state_hash
from .quant import quantize_state
from .tensors import dtype_name, to_bits, uint_type

State = Mapping[str, torch.Tensor]
CHUNK_ELEMS = 1 << 22
ZSTD_LEVEL = 3
# Above this density a plain bitmask is tried against the Rice code.
MASK_TRY_DENSITY = 0.2
# Where the element pass runs: None picks torch (torch_pass) for tensors on
# CUDA and the compiled kernels otherwise; "torch" or "numba" forces one
# (the tests hold the two to the same bytes on CPU).
ELEMENT_PASS: str | None = None


@dataclass
class PatchStats:
    precision: str
    elements: int = 0
    changed: int = 0
    tensors_changed: int = 0
    patch_bytes: int = 0
    full_bytes: int = 0
    position_bytes: int = 0
    residual_bytes: int = 0
    base_hash: str = ""
    result_hash: str = ""
    codes: dict[str, int] = field(default_factory=dict)

    @property
    def density(self) -> float:
        return self.changed / self.elements if self.elements else 0.0

    @property
    def ratio(self) -> float:
        return self.patch_bytes / self.full_bytes if self.full_bytes else 0.0

    @property
    def bits_per_changed(self) -> float:
        return 8 * self.patch_bytes / self.changed if self.changed else 0.0

    def as_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d.update(density=self.density, ratio=self.ratio, bits_per_changed=self.bits_per_changed)
        return d


def prepare(state: State, precision: str) -> dict[str, torch.Tensor]:
    """The state a receiver holds at this precision.

    "exact": as given. "bf16": float tensors rounded to bf16. "int8": bf16
    first, then 2-D weights quantized per row (codes + scales), so that a
    scale moves only when its row's bf16 maximum does.
    """
    if precision == "exact":
        return dict(state)
    if precision not in ("bf16", "int8"):
        raise ValueError(f"precision must be exact, bf16 or int8, not {precision!r}")
    bf = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in state.items()}
    return quantize_state(bf) if precision == "int8" else bf


def _full_entry(name: str, t: torch.Tensor) -> tuple[dict, list[bytes]]:
    raw = to_bits(t).tobytes()
    packed = positions.compress(raw, 1)
    use = len(packed) < len(raw)
    entry = {
        "name": name,
        "op": "full",
        "dtype": dtype_name(t),
        "shape": list(t.shape),
        "zstd": use,
        "blocks": [len(packed) if use else len(raw)],
    }
    return entry, [packed if use else raw]


def _rice_pass(ob, nb, cmap, res: residuals.ResidualParts):
    """Code the positions chunk by chunk, gathering the residuals in the same order.

    The element passes of a large tensor's chunks run on every core
    (`parallel.ordered`); coding follows in chunk order on this thread.
    """
    rice = positions.RiceEncoder(cmap)
    changed = 0
    bounds = list(positions.chunk_bounds(ob.size, CHUNK_ELEMS))
    key = residuals.key_kind(res.dtype)
    passes = parallel.ordered(
        functools.partial(rice.changes, start, nb[start:stop], key) for _, start, stop in bounds
    )
    for (ci, _start, _stop), found in zip(bounds, passes, strict=True):
        local = rice.code(ci, found)
        if local.size:
            changed += local.size
            res.extend(*found[4:])
    return rice, changed


def _mask_block(ob, nb) -> bytes:
    """The "mask" code, its bitmask built slice by slice."""
    packed = [
        np.packbits(ob[start:stop] != nb[start:stop])
        for _, start, stop in positions.chunk_bounds(ob.size, positions.MASK_STEP)
    ]
    return positions.mask_block(packed, ZSTD_LEVEL)


def _gather_ascending(ob, nb, res: residuals.ResidualParts) -> None:
    """The residuals in the bitmask's order (ascending), slice by slice."""
    for _, start, stop in positions.chunk_bounds(ob.size, positions.MASK_STEP):
        o, n = ob[start:stop], nb[start:stop]
        local = np.flatnonzero(o != n)
        res.add(o[local], n[local])


def _encode_changes(name, ctx, old_state, ob, nb, dtype):
    """(position code, e0, position blocks, residual coding, changed) or None.

    Chunk by chunk, so that the memory beyond the two tensors is one chunk's
    work plus two small integers per changed element. A dense tensor that
    might be cheaper as a bitmask pays a second pass to find out (and a third
    to regather its residuals in the bitmask's order if it is).
    """
    cmap = class_map(name, ctx, old_state, ob)
    res = residuals.ResidualParts(dtype, ob.dtype.type, ob.size)
    rice, changed = _rice_pass(ob, nb, cmap, res)
    if changed == 0:
        return None
    code, blocks = "rice", rice.blocks(ZSTD_LEVEL)
    classes = positions.residual_classes(rice.groups)
    if changed > MASK_TRY_DENSITY * ob.size:
        m = _mask_block(ob, nb)
        if len(m) < sum(map(len, blocks)):
            res = residuals.ResidualParts(dtype, ob.dtype.type, ob.size)
            _gather_ascending(ob, nb, res)
            code, blocks, classes = "mask", [m], np.zeros(changed, np.uint8)
    return code, cmap.e0, blocks, res.encode(classes), changed


def _encode_on_device(name, ctx, old_state, old, new, dtype):
    """_encode_changes with the element pass where the tensors are (torch_pass):
    only the changes cross to the CPU. A tensor dense enough to be worth a
    bitmask is coded on the CPU instead (rare: never for an optimizer step)."""
    key = residuals.key_kind(dtype)
    e0, passes = torch_pass.changes(name, ctx, old_state, old, new, CHUNK_ELEMS, key)
    changed = sum(found[0].size for found in passes)
    if changed == 0:
        return None
    if changed > MASK_TRY_DENSITY * old.numel():
        return _encode_changes(name, ctx, old_state, to_bits(old), to_bits(new), dtype)
    rice = positions.RiceEncoder(None)
    res = residuals.ResidualParts(dtype, uint_type(old.element_size()), old.numel())
    for ci, found in enumerate(passes):
        if rice.code(ci, found).size:
            res.extend(*found[4:])
    classes = positions.residual_classes(rice.groups)
    return "rice", e0, rice.blocks(ZSTD_LEVEL), res.encode(classes), changed


def _on_device(old: torch.Tensor, new: torch.Tensor) -> bool:
    """Whether the element pass runs in torch (ELEMENT_PASS, else: both on CUDA)."""
    if ELEMENT_PASS is not None:
        return ELEMENT_PASS == "torch"
    return old.device.type == "cuda" and new.device == old.device


def _encode_tensor(name: str, old_state: State, new: torch.Tensor):
    """(entry, blocks, changed elements) for one tensor of the new state, or None."""
    old = old_state.get(name)
    if old is new:  # the same tensor (a LoRA run's kept base): no element to compare
        return None
    if old is None or old.dtype != new.dtype or old.shape != new.shape:
        entry, blocks = _full_entry(name, new)
        return entry, blocks, new.numel()
    dtype = dtype_name(new)
    ctx = choose_context(name, old, old_state)
    if _on_device(old, new):
        found = _encode_on_device(name, ctx, old_state, old, new, dtype)
    else:
        found = _encode_changes(name, ctx, old_state, to_bits(old), to_bits(new), dtype)
    if found is None:
        return None
    code, e0, pos_blocks, (res, layout, res_blocks), changed = found
    entry = {
        "name": name,
        "op": "patch",
        "dtype": dtype,
        "shape": list(new.shape),
        "ctx": ctx,
        "e0": e0,
        "pos": code,
        "res": res,
        "rlayout": layout,
        "changed": changed,
    }
    blocks = [*pos_blocks, *res_blocks]
    entry["blocks"] = [len(b) for b in blocks]
    return entry, blocks, changed


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def encode(
    old: State,
    new: State,
    *,
    precision: str = "bf16",
    base_hash: str | None = None,
    result_hash: str | None = None,
    hash_algo: str = DEFAULT_HASH,
) -> tuple[bytes, PatchStats]:
    """A patch that turns prepare(old) into prepare(new), and its statistics.

    base_hash / result_hash: hashes the caller already holds (a trainer
    knows the hash of the version it published last), to skip re-hashing;
    otherwise they are computed with `hash_algo`.
    """
    old_p, new_p = prepare(old, precision), prepare(new, precision)
    names = sorted(new_p)
    sizes = [_nbytes(new_p[n]) for n in names]
    base_hash = base_hash or state_hash(old_p, hash_algo)
    hash_new = result_hash is None

    def encoded(name: str):
        # Without a result hash, each new tensor is hashed on the thread that
        # has just read it, beside the others' work (as `apply` does).
        found = _encode_tensor(name, old_p, new_p[name])
        return found, leaf_hash(new_p[name], hash_algo, threaded=False) if hash_new else ""

    pairs = parallel.budgeted_map(encoded, names, sizes, parallel.tensor_budget(sizes))
    results = [found for found, _ in pairs]
    if hash_new:
        leaves = {n: leaf for n, (_, leaf) in zip(names, pairs, strict=True)}
        result_hash = state_hash(new_p, hash_algo, leaves)
    stats = PatchStats(precision, base_hash=base_hash, result_hash=result_hash)
    entries, blocks = [], []
    for name, r in zip(names, results, strict=True):
        t = new_p[name]
        stats.elements += t.numel()
        stats.full_bytes += _nbytes(t)
        if r is None:
            continue
        entry, bl, changed = r
        _count(stats, entry, changed)
        entries.append(entry)
        blocks.extend(bl)
    for name in sorted(set(old_p) - set(new_p)):
        entries.append({"name": name, "op": "drop", "blocks": []})
    header = {
        "precision": precision,
        "base_hash": base_hash,
        "result_hash": result_hash,
        "chunk_elems": CHUNK_ELEMS,
        "tensors": entries,
        "payload_bytes": sum(len(b) for b in blocks),
    }
    data = pack(header, blocks)
    stats.patch_bytes = len(data)
    return data, stats


def _count(stats: PatchStats, entry: dict, changed: int) -> None:
    stats.changed += changed
    stats.tensors_changed += 1
    key = entry["op"]
    if key == "patch":
        key = f"{entry['pos']}+{entry['res']}/{entry['rlayout']}"
    stats.codes[key] = stats.codes.get(key, 0) + 1
    if entry["op"] == "patch":
        n_pos = POSITION_BLOCKS[entry["pos"]]
        stats.position_bytes += sum(entry["blocks"][:n_pos])
        stats.residual_bytes += sum(entry["blocks"][n_pos:])


def diff(old: State, new: State, *, precision: str = "bf16", **hashes: str | None) -> bytes:
    """The patch alone; see `encode`."""
    return encode(old, new, precision=precision, **hashes)[0]
