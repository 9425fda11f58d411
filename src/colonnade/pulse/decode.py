"""Applying a PULSE patch: rebuild the new state and prove it is the right one.

Every check that can fail does so before a result exists: the base must hash
to the patch's base_hash, every block must decode to exactly its declared
size, and the rebuilt state must hash to result_hash (each with the
algorithm the hash names). Unchanged tensors are shared with the base (never
written); changed ones are fresh copies, so a failed apply leaves the
caller's base untouched, or (in_place) rebuilt inside the base's tensors with
an undo log of the old bits of what changed (a small share of the state),
which a failed apply plays back.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch

from . import kernels, parallel, positions, residuals
from .codec import State, _nbytes
from .context import class_map
from .errors import PatchError
from .format import POSITION_BLOCKS, unpack
from .hashing import algo_of, leaf_hash, state_hash
from .quant import SCALE_SUFFIX
from .tensors import dtype_name, from_bits, itemsize, to_bits


def _split(payload: memoryview, entries: list[dict]) -> list[list[memoryview]]:
    out, off = [], 0
    for e in entries:
        blocks = []
        for n in e["blocks"]:
            blocks.append(payload[off : off + n])
            off += n
        out.append(blocks)
    return out


def _decode_full(entry: dict, blocks: list[memoryview]) -> torch.Tensor:
    shape = tuple(entry["shape"])
    size = itemsize(entry["dtype"])
    nbytes = size * int(np.prod(shape, dtype=np.int64))
    raw = positions.decompress(bytes(blocks[0]), nbytes) if entry["zstd"] else bytes(blocks[0])
    if len(raw) != nbytes:
        raise ValueError(f"full tensor holds {len(raw)} bytes, expected {nbytes}")
    bits = np.frombuffer(raw, dtype=np.dtype(f"<u{size}")).astype(f"=u{size}")
    return from_bits(bits.copy(), entry["dtype"], shape)


def _decode_patch(
    entry: dict, blocks: list[memoryview], base: State, ctx_state: State, chunk: int, undo
) -> torch.Tensor:
    """The patched tensor; written into the base's own memory where `undo` is a
    list (and the base tensor a plain CPU one), the old bits of every changed
    element logged there first."""
    name = entry["name"]
    old = base.get(name)
    if old is None:
        raise ValueError("the base has no such tensor")
    if dtype_name(old) != entry["dtype"] or list(old.shape) != entry["shape"]:
        raise ValueError(
            f"base tensor is {dtype_name(old)} {list(old.shape)}, "
            f"patch expects {entry['dtype']} {entry['shape']}"
        )
    if entry["ctx"] == "rowscale" and name + "::scale" not in base:
        raise ValueError("rowscale context without a scale tensor in the base")
    ob = to_bits(old)
    changed = entry["changed"]
    n_pos = POSITION_BLOCKS[entry["pos"]]
    if entry["pos"] == "rice":
        cmap = class_map(name, entry["ctx"], ctx_state, ob, entry["e0"])
        groups = positions.read_groups(blocks[0], ob.size, chunk)
        coded = int(groups["count"].sum(dtype=np.int64))
        if coded != changed:
            raise ValueError(f"positions hold {coded} changes, header says {changed}")
        classes = positions.residual_classes(groups)
    else:
        classes = np.zeros(changed, np.uint8)
    values = residuals.decode_values(entry, blocks[n_pos:], classes, changed, ob.dtype.type)
    del classes
    in_place = undo is not None and _own_memory(old, ob)
    nb = ob if in_place else np.empty_like(ob)
    if entry["pos"] == "rice":
        spec = positions.Rebuild(
            values,
            nb,
            _RES[entry["res"]],
            residuals.key_kind(entry["dtype"]),
            undo if in_place else None,
        )
        found = positions.rice_chunks(groups, blocks[1:n_pos], ob.size, cmap, chunk, spec)
        _rebuild_all(nb, ob, found, values.size, chunk)
    else:
        if not in_place:
            np.copyto(nb, ob)
        _scatter(entry, nb, positions.mask_chunks(blocks[0], ob.size), values, undo)
    if in_place:
        return old
    return from_bits(nb, entry["dtype"], tuple(old.shape))


_RES = {"xor": kernels.RES_XOR, "delta": kernels.RES_DELTA}


def _rebuild_all(nb, ob, found, count: int, chunk: int) -> None:
    """Run the rice path's chunks (rebuilt as they go, each logging its own
    undo); the chunks without changes copied where nb is not the base's own
    memory."""
    done, seen = 0, set()
    for start, local, _ in found:
        seen.add(start)
        done += local.size
    if done != count:
        raise ValueError(f"decoded {done} changed elements, header says {count}")
    if nb is not ob:
        for _, start, stop in positions.chunk_bounds(ob.size, chunk):
            if start not in seen:
                nb[start:stop] = ob[start:stop]


def _own_memory(t: torch.Tensor, bits: np.ndarray) -> bool:
    """Whether `bits` is the tensor's own memory (not a copy to_bits made)."""
    return bits.flags.writeable and bits.size > 0 and bits.ctypes.data == t.data_ptr()


def _scatter(entry: dict, nb: np.ndarray, chunks, values: np.ndarray, undo) -> None:
    """Each chunk's changes rebuilt in place in `nb` (the old bits logged to `undo`).

    Chunk by chunk, so that no index array spans the whole tensor.
    """
    done = 0
    for start, local in chunks:
        if done + local.size > values.size:
            raise ValueError(f"positions hold more changes than the header's {values.size}")
        seg = nb[start:]
        before = seg[local]
        if undo is not None:
            undo.append((nb, start, local, before))
        seg[local] = residuals.rebuild(entry, before, values[done : done + local.size])
        done += local.size
    if done != values.size:
        raise ValueError(f"decoded {done} changed elements, header says {values.size}")


def _undo(logs) -> None:
    """Put back the old bits of every element an in-place apply changed."""
    for log in logs:
        for nb, start, local, before in reversed(log):
            nb[start:][local] = before


def _entry_cost(entry: dict, base: State) -> int:
    old = base.get(entry["name"])
    if entry["op"] == "patch" and old is not None:
        return _nbytes(old)
    return sum(entry["blocks"])


def _decode_entry(entry, blocks, base, ctx_state, chunk, undo):
    try:
        if entry["op"] == "full":
            return _decode_full(entry, blocks)
        return _decode_patch(entry, blocks, base, ctx_state, chunk, undo)
    except (ValueError, IndexError) as e:
        raise PatchError(f"corrupt patch: tensor {entry['name']!r}: {e}") from None


def apply(
    base: State,
    patch: bytes | memoryview,
    *,
    base_hash: str | None = None,
    in_place: bool = False,
) -> dict[str, torch.Tensor]:
    """The state the patch describes, checked against its hash.

    base_hash: the hash of `base` if the caller already verified it (a
    worker knows the hash of the state it is running); otherwise it is
    computed. Raises PatchError for any patch that does not fit this base.

    in_place: rebuild the changed elements inside the base's own tensors
    (plain CPU tensors that share memory with no other tensor of the base;
    others are copied as usual), so that no second copy
    of the state exists; the result shares them. For a receiver whose engine
    can take new bits under it. If anything fails, every element written is
    put back before PatchError is raised: the base is then as it was.
    """
    c = unpack(patch)
    h = c.header
    have = base_hash if base_hash is not None else state_hash(base, algo_of(h["base_hash"]))
    if have != h["base_hash"]:
        raise PatchError(
            f"wrong base: patch is for base {h['base_hash'][:19]}…, this state is {have[:19]}…"
        )
    entries = [e for e in h["tensors"] if e["op"] != "drop"]
    dropped = {e["name"] for e in h["tensors"] if e["op"] == "drop"}
    if not dropped <= set(base):
        raise PatchError("corrupt patch: drops a tensor the base does not have")
    blocks = _split(c.payload, entries)
    # Contexts read the base's row scales, which an in-place apply may be
    # rewriting on another thread: those (one number a row) are read from a copy.
    ctx_state = _context_state(base, entries) if in_place else base
    logs: list[list] | None = [[] for _ in entries] if in_place else None
    # Tensors sharing memory with another of the base are rebuilt as copies:
    # a leaf is hashed as soon as its own tensor is done, which another
    # tensor's writes must not change afterwards.
    shared = _shared_storage(base) if in_place else set()
    # A patched tensor's working memory follows its size; a full one's its bytes.
    costs = [_entry_cost(e, base) for e in entries]
    algo = algo_of(h["result_hash"])

    def rebuilt(i: int) -> tuple[torch.Tensor, str]:
        # Hashed on this thread as soon as it is rebuilt, while the other
        # threads still work (a hash of the whole state after them all was
        # a sizeable share of an apply, on fewer cores).
        old = base.get(entries[i]["name"])
        own = old is not None and _storage(old) not in shared
        undo = logs[i] if logs is not None and own else None
        t = _decode_entry(entries[i], blocks[i], base, ctx_state, h["chunk_elems"], undo)
        return t, leaf_hash(t, algo, threaded=False)

    try:
        decoded = parallel.budgeted_map(
            rebuilt,
            list(range(len(entries))),
            costs,
            parallel.tensor_budget([_nbytes(t) for t in base.values()]),
        )
        result = {k: v for k, v in base.items() if k not in dropped}
        result.update({e["name"]: t for e, (t, _) in zip(entries, decoded, strict=True)})
        leaves = {e["name"]: leaf for e, (_, leaf) in zip(entries, decoded, strict=True)}
        got = state_hash(result, algo, leaves)
        if got != h["result_hash"]:
            raise PatchError(
                f"corrupt patch: rebuilt state hashes to {got[:19]}…, "
                f"patch promises {h['result_hash'][:19]}…"
            )
    except BaseException:
        if logs:
            _undo(logs)
        raise
    return result


def _storage(t: torch.Tensor) -> tuple[str, int]:
    return t.device.type, t.untyped_storage().data_ptr()


def _shared_storage(base: State) -> set[tuple[str, int]]:
    """The storages that more than one tensor of `base` lives in."""
    seen: set[tuple[str, int]] = set()
    shared: set[tuple[str, int]] = set()
    for t in base.values():
        key = _storage(t)
        (shared if key in seen else seen).add(key)
    return shared


def _context_state(base: State, entries: list[dict]) -> dict[str, torch.Tensor]:
    out = dict(base)
    for e in entries:
        scale = e["name"] + SCALE_SUFFIX
        if e.get("ctx") == "rowscale" and scale in base:
            out[scale] = base[scale].clone()
    return out


def read_header(patch: bytes | memoryview) -> Mapping[str, object]:
    """The checked header of a patch (for inspection tools)."""
    return unpack(patch).header
