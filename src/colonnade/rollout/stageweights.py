"""A pipeline stage's weights: the run's versions, its own tensors only.

A stage-worker (`stageworker.py`) follows the published versions as any
worker does (`protocol.Follower`: the newest anchor once, then every patch
in order, back to the anchor when a patch does not fit), with the same
interface, so `rollout.weights.Weights` fetches and installs for it. It
holds only the tensors its stage runs (`mine`: `engine.stages.StageNames`),
never the whole model:

- from an anchor, the file is streamed to disk and its signed hash checked;
  then its tensors are read one at a time, each hashed into the state's
  table (`pulse.hashing`) and dropped unless it is the stage's. The table
  of every tensor's leaf hash proves the stage's tensors are the signed
  version's, though the stage keeps a fraction of them;
- a patch is checked against its signed payload hash, and it must name as
  its base the signed state hash of the version the stage holds; its
  entries for the stage's tensors are decoded, the rest skipped. The
  rebuilt state's hash covers every stage's tensors, which no stage holds,
  so it is not checked here: the signed payload rules out a forged patch,
  and a wrong rebuild (a decoder fault) shows in the trainer's check of
  every batch's log-probs against its own (docs/security.md).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from colonnade import pulse
from colonnade.protocol import Follower, VersionError, keys
from colonnade.protocol.schemas import VersionMeta
from colonnade.protocol.signing import Trust
from colonnade.pulse.decode import _decode_entry, _split  # one tensor of a patch at a time
from colonnade.pulse.format import unpack
from colonnade.pulse.hashing import algo_of, leaf_hash
from colonnade.store import ObjectStore, ObjectTooLarge

# safetensors' dtype names
_DTYPES = {"BOOL": torch.bool, "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16,
           "I32": torch.int32, "I64": torch.int64, "F16": torch.float16,
           "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64}  # fmt: skip


def _read_tensors(path: Path):
    """(name, tensor) of each tensor of a safetensors file in turn, read
    rather than mapped: a mapping keeps every page it touched resident until
    it closes, so hashing an anchor through one would hold the whole model
    in the stage's resident memory, not its own share."""
    size = path.stat().st_size
    with path.open("rb") as f:
        n = int.from_bytes(f.read(8), "little")
        if not 0 < n <= size - 8:
            raise ValueError("header length")
        header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        for name, info in header.items():
            start, end = info["data_offsets"]
            if not 0 <= start <= end <= size - 8 - n:
                raise ValueError(f"{name}: offsets out of the file")
            data = bytearray(end - start)
            f.seek(8 + n + start)
            if f.readinto(data) != len(data):
                raise ValueError(f"{name}: short read")
            dtype = _DTYPES[info["dtype"]]
            flat = torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)
            yield name, flat.reshape(info["shape"])


def _payload(store: ObjectStore, key: str, size: int, digest: str) -> bytes:
    """The object at `key`, checked against the size and hash meta.json sign."""
    try:
        data = store.get(key, max_bytes=size)
    except ObjectTooLarge:
        raise VersionError(f"{key}: payload is larger than meta.json says") from None
    if pulse.digest_bytes(data, algo_of(digest)) != digest:
        raise VersionError(f"{key}: payload hash differs from meta.json")
    return data


class StageFollower(Follower):
    """The newest published version's tensors that `mine(name)` holds,
    rebuilt and checked (the module docstring says how far). `sync` and the
    order of anchors and patches are `Follower`'s; what is read of each is
    the stage's."""

    def __init__(
        self, store: ObjectStore, anchor_every: int, trust: Trust, mine: Callable[[str], bool]
    ):
        # Not in place: a patch's changed tensors are new ones, so a worker
        # tells what to load again by identity.
        super().__init__(store, anchor_every, trust, in_place=False)
        self.mine = mine

    def _from_anchor(self, target: VersionMeta) -> None:
        anchor = self._meta(target.anchor)
        self.state = self._load_anchor(anchor)
        self.version, self.state_hash = anchor.version, anchor.state_hash
        self.bytes_read += anchor.anchor_bytes
        self.anchors_read += 1
        self._patch_to(target.version)

    def _load_anchor(self, meta: VersionMeta) -> dict[str, torch.Tensor]:
        """The stage's tensors of anchor `meta`, every tensor hashed on the way."""
        key = keys.full_key(meta.version)
        if not meta.anchor_bytes:
            raise VersionError(f"v{meta.version} is not an anchor")
        algo = algo_of(meta.state_hash)
        with tempfile.TemporaryDirectory(prefix="colonnade-stage-anchor-") as tmp:
            path = Path(tmp) / "full.safetensors"
            try:
                self.store.get_file(key, path, max_bytes=meta.anchor_bytes)
            except ObjectTooLarge:
                raise VersionError(f"{key}: payload is larger than meta.json says") from None
            if pulse.digest_file(path, algo_of(meta.anchor_hash)) != meta.anchor_hash:
                raise VersionError(f"{key}: payload hash differs from meta.json")
            own, shells, leaves = {}, {}, {}
            try:
                for name, t in _read_tensors(path):
                    leaves[name] = leaf_hash(t, algo)
                    if self.mine(name):
                        own[name] = t
                    else:  # its table line only: dtype, shape, leaf
                        shells[name] = torch.empty(t.shape, dtype=t.dtype, device="meta")
                    del t
            except (ValueError, KeyError, TypeError, RuntimeError, OSError) as e:
                raise VersionError(f"{key}: not a readable safetensors file ({e})") from None
        if pulse.state_hash({**shells, **own}, algo, leaves) != meta.state_hash:
            raise VersionError(f"v{meta.version}: anchor does not hash to meta.json's state_hash")
        return own

    def _patch_to(self, target: int) -> None:
        while self.version < target:
            meta = self._meta(self.version + 1)
            patch = _payload(self.store, keys.patch_key(meta.version), meta.patch_bytes,
                             meta.patch_hash)  # fmt: skip
            self.state = self._apply(meta, patch)
            self.bytes_read += meta.patch_bytes
            self.version, self.state_hash = meta.version, meta.state_hash

    def _apply(self, meta: VersionMeta, patch: bytes) -> dict[str, torch.Tensor]:
        """The stage's tensors after `patch`: the changed ones new tensors
        (a worker tells what to load again by identity), the rest shared."""
        container = unpack(patch)
        h = container.header
        if h["result_hash"] != meta.state_hash:
            raise VersionError(f"v{meta.version}: patch and meta.json disagree")
        if h["base_hash"] != self.state_hash:
            raise pulse.PatchError(f"v{meta.version}: a patch of another base than v{self.version}")
        entries = [e for e in h["tensors"] if e["op"] != "drop"]
        blocks = _split(container.payload, entries)
        state = dict(self.state)
        for e in h["tensors"]:
            if e["op"] == "drop" and self.mine(e["name"]):
                state.pop(e["name"], None)
        # Each decoded against the stage's own base: a layer's scales, which
        # a row-scale context reads, are that layer's and so the stage's.
        base = dict(self.state)
        for entry, parts in zip(entries, blocks, strict=True):
            if self.mine(entry["name"]):
                state[entry["name"]] = _decode_entry(
                    entry, parts, base, base, h["chunk_elems"], None
                )
        return state
