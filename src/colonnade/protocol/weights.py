"""Publishing versions of the weights, and following them from a worker.

The trainer publishes v0 as a full anchor, then every version as a PULSE
patch against the previous one, anchors included: every K versions the full
state goes up beside the patch, for joiners. The payloads go first,
`meta.json` last with put-if-absent: a crash leaves an unreferenced payload,
never a visible half version. A follower applies the patches in order and
never downloads an anchor while it keeps up; it starts over from the newest
anchor when it joins, is more than K behind, or a patch does not rebuild to
the hash that `meta.json` promises. It never holds a state whose hash
differs from the meta.

Every meta.json and latest.json is signed by the trainer (protocol 7): a
follower reads them through the `Trust` it pinned, so a document anyone
else wrote is a damaged version, never an installed one; and the payloads
are checked against the signed hashes.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file as st_save_file

from colonnade import pulse
from colonnade.progress import Transfer, folder_bytes
from colonnade.pulse.hashing import algo_of
from colonnade.store import NotFound, ObjectStore, ObjectTooLarge

from . import keys
from .documents import put_back, sealed
from .polling import moving_gap
from .schemas import MAX_JSON_BYTES, Demand, Latest, SchemaError, VersionMeta
from .signing import Signer, Trust

log = logging.getLogger("colonnade.trainer")
_wlog = logging.getLogger("colonnade.worker")  # an anchor is downloaded by a worker (or an eval)

State = Mapping[str, torch.Tensor]


class VersionError(RuntimeError):
    """A published version that cannot be rebuilt as its meta promises."""


@dataclass
class Published:
    meta: VersionMeta
    seconds: float


class Publisher:
    """Trainer side: turns successive float states into published versions."""

    def __init__(
        self,
        store: ObjectStore,
        signer: Signer,
        precision: str,
        anchor_every: int,
        hash_algo: str = "blake3",
    ):
        self.store, self.precision, self.anchor_every = store, precision, anchor_every
        self.signer = signer
        self.hash_algo = hash_algo  # of new versions' state and payload hashes
        self.last: dict[str, torch.Tensor] | None = None  # prepared state of `version`
        self.last_hash: str | None = None
        self.version: int | None = None
        self.meta: VersionMeta | None = None  # of `version`, once published here
        self.quarantined = 0  # decisions so far, announced in latest.json
        self.demand: Demand | None = None  # announced in latest.json
        self.version_seconds: float | None = None  # moving average, announced too
        # meta.created of the last version published here: an interval counts
        # only between two versions of this trainer's life (not across a
        # resume, where it would hold the downtime).
        self._created: float | None = None
        # latest.json is written by the publication (a background job) and
        # by the trainer's main thread when the demand changes mid-version.
        self._pointing = threading.Lock()
        self.latest_bytes: bytes | None = None  # latest.json as last written here
        # A LoRA run's base never changes: once a version is published, the
        # trainer sends the adapters alone and the rest is the last version's.
        self.keep_rest = False

    def adopt(self, version: int, prepared: dict[str, torch.Tensor], state_hash: str) -> None:
        """Continue after `version`, whose prepared state is already published."""
        self.version, self.last, self.last_hash = version, prepared, state_hash

    def publish(self, state: State, demand: Demand | None = None) -> Published:
        """Publish `state` as the next version: its patch from the last one
        (every version but v0), its full state too at an anchor, meta.json last;
        latest.json then names it, with `demand` (the slots of this version).
        With `keep_rest`, `state` may hold only the tensors that changed."""
        t0 = time.perf_counter()
        v = 0 if self.version is None else self.version + 1
        if v > 0 and self.last is None:
            raise VersionError(f"v{v}: no published state to patch from (adopt one first)")
        new = pulse.prepare(state, self.precision)
        if self.keep_rest and self.last is not None:
            unknown = sorted(set(new) - set(self.last))
            if unknown:
                raise VersionError(f"v{v}: tensors the published state lacks: {unknown[:3]}")
            new = {**self.last, **new}  # the unchanged tensors shared, not copied
        algo = self.hash_algo
        sizes: dict[str, int | str] = {}
        if v == 0:
            state_hash = pulse.state_hash(new, algo)
        else:
            # A patch names its base by the base's own hash: after a resume that
            # adopted a version hashed otherwise, hash the base again.
            base_hash = self.last_hash
            if base_hash is None or not base_hash.startswith(algo + ":"):
                base_hash = pulse.state_hash(self.last, algo)
            # The encoder hashes the new state beside its own work.
            payload, stats = pulse.encode(
                self.last, new, precision="exact", base_hash=base_hash, hash_algo=algo
            )
            state_hash = stats.result_hash
            self.store.put(keys.patch_key(v), payload)
            sizes.update(patch_bytes=len(payload), patch_hash=pulse.digest_bytes(payload, algo))
        if v % self.anchor_every == 0:
            # Through a file, streamed up (multipart when large): an anchor
            # never sits in memory beside the state it encodes.
            with tempfile.TemporaryDirectory(prefix="colonnade-anchor-") as tmp:
                path = Path(tmp) / "full.safetensors"
                st_save_file(new, path)
                sizes.update(anchor_bytes=path.stat().st_size,
                             anchor_hash=pulse.digest_file(path, algo))  # fmt: skip
                with Transfer(log.info, f"uploading v{v}'s anchor", sizes["anchor_bytes"]):
                    self.store.put_file(keys.full_key(v), path)
        meta = VersionMeta(
            version=v,
            anchor=v - v % self.anchor_every,
            state_hash=state_hash,
            full_bytes=sum(t.numel() * t.element_size() for t in new.values()),
            created=time.time(),
            **sizes,
        )
        key = keys.meta_key(v)
        if not self.store.put_if_absent(key, sealed(self.signer, key, meta)):
            # A retry after an outage may find its own earlier write: same state, fine.
            try:
                existing = read_meta(self.store, v, self.signer.trust)
            except SchemaError as e:
                # Not ours (a writer with the workers' credentials squatted
                # the key): no worker would take it, so it is overwritten.
                log.warning("%s was written by someone else (%s): overwritten", key, e)
                self.store.put(key, sealed(self.signer, key, meta))
                existing = meta
            if existing is None or existing.state_hash != state_hash:
                raise VersionError(f"version {v} is already published: is another trainer running?")
        with self._pointing:
            if self._created is not None:  # set by this publisher's v - 1
                gap = max(0.0, meta.created - self._created)
                self.version_seconds = moving_gap(self.version_seconds, gap)
            self._created = meta.created
            self.meta = meta
            if demand is not None:
                self.demand = demand
            self._point(False)
        self.adopt(v, new, state_hash)
        return Published(meta, time.perf_counter() - t0)

    def point(self, done: bool = False) -> None:
        """Rewrite weights/latest.json for the newest version (published here,
        or adopted on resume)."""
        with self._pointing:
            self._point(done)

    def announce(self, demand: Demand) -> bool:
        """A new demand, into latest.json now; False (nothing written) when it
        is older than the one announced, which a publication may just have
        replaced, or the same."""
        with self._pointing:
            if self.demand is not None and (
                demand.version < self.demand.version or demand == self.demand
            ):
                return False
            self.demand = demand
            self._point(False)
            return True

    def _point(self, done: bool) -> None:
        if self.meta is None and self.version is not None:
            self.meta = read_meta(self.store, self.version, self.signer.trust)
        if self.meta is not None:
            demand = None if done else self.demand
            gap = None if self.version_seconds is None else round(self.version_seconds, 3)
            latest = Latest(self.meta.version, self.meta, done, self.quarantined, demand, gap)
            self.latest_bytes = sealed(self.signer, keys.LATEST, latest)
            self.store.put(keys.LATEST, self.latest_bytes)

    def guard(self) -> bool:
        """latest.json as this trainer last wrote it, written again if anyone
        replaced or removed it; whether it had to be."""
        with self._pointing:
            mine = self.latest_bytes
            return mine is not None and put_back(self.store, keys.LATEST, mine)


def _signed(store: ObjectStore, key: str, cls, trust: Trust):
    """The trainer's document at `key` (None where missing); SchemaError
    (SignatureRejected among them) for one that does not read or verify."""
    try:
        data = store.get(key, max_bytes=MAX_JSON_BYTES)
    except NotFound:
        return None
    except ObjectTooLarge as e:
        raise SchemaError(f"{key}: {e}") from None
    return cls.from_dict(trust.open(key, data))


def read_meta(store: ObjectStore, v: int, trust: Trust) -> VersionMeta | None:
    """weights/{v}/meta.json, None where missing; SchemaError where it is not
    the trainer's (bad signature included) or not of version v."""
    meta = _signed(store, keys.meta_key(v), VersionMeta, trust)
    if meta is not None and meta.version != v:
        raise SchemaError(f"{keys.meta_key(v)} describes version {meta.version}")
    return meta


def needed_meta(store: ObjectStore, v: int, trust: Trust,
                known: VersionMeta | None = None) -> VersionMeta:  # fmt: skip
    """Version `v`'s meta.json (`known` if it is v's), or a VersionError: a
    follower retries a version that is missing or does not verify."""
    if known is not None and known.version == v:
        return known
    try:
        meta = read_meta(store, v, trust)
    except SchemaError as e:
        # Damage or forgery, like a bad payload: the worker retries, where
        # a SchemaError would have ended it at once.
        raise VersionError(f"version {v}: meta.json does not verify ({e})") from None
    if meta is None:
        raise VersionError(f"version {v} has no meta.json")
    return meta


def read_latest(store: ObjectStore, trust: Trust) -> Latest | None:
    """weights/latest.json, None where missing; SchemaError where it does not
    read or verify."""
    return _signed(store, keys.LATEST, Latest, trust)


def latest_version(store: ObjectStore, trust: Trust) -> int | None:
    """The newest published version, for certain: the pointer in latest.json,
    then probing forward (a pointer write can fail after its meta.json).
    Only what the trainer signed counts. Workers poll `read_latest` alone."""
    try:
        latest = read_latest(store, trust)
    except SchemaError:
        latest = None
    v = latest.version if latest is not None else None
    if v is None:
        found = sorted(
            {v for k in store.list(keys.WEIGHTS) if (v := keys.parse_meta_key(k)) is not None},
            reverse=True,
        )
        v = next((u for u in found if _readable(store, u, trust)), None)
        if v is None:
            return None
    while _readable(store, v + 1, trust):
        v += 1
    return v


def _readable(store: ObjectStore, v: int, trust: Trust) -> bool:
    try:
        return read_meta(store, v, trust) is not None
    except SchemaError:
        return False


def _payload(store: ObjectStore, key: str, size: int, digest: str) -> bytes:
    """The object at `key`, checked against the size and hash meta.json promise."""
    try:
        data = store.get(key, max_bytes=size)
    except ObjectTooLarge:
        # Longer than meta.json says is damage, like a hash mismatch: as a
        # StoreError it skipped the anchor fallback, and the worker retried it
        # as an outage without end.
        raise VersionError(f"{key}: payload is larger than meta.json says") from None
    if not _same(pulse.digest_bytes, data, digest):
        raise VersionError(f"{key}: payload hash differs from meta.json")
    return data


def _same(digest, data, expected: str) -> bool:
    """Whether `data` digests to `expected`, with the algorithm it names."""
    return digest(data, algo_of(expected)) == expected


def load_full(store: ObjectStore, meta: VersionMeta) -> dict[str, torch.Tensor]:
    """The full state of anchor version `meta`, downloaded to a file (streamed
    or in ranged GETs), its hash checked, then loaded: never twice in memory."""
    key = keys.full_key(meta.version)
    if not meta.anchor_bytes:
        raise VersionError(f"v{meta.version} is not an anchor")
    with tempfile.TemporaryDirectory(prefix="colonnade-anchor-") as tmp:
        path = Path(tmp) / "full.safetensors"
        what = f"downloading v{meta.version}'s anchor"
        try:
            with Transfer(_wlog.info, what, meta.anchor_bytes, partial(folder_bytes, tmp)):
                store.get_file(key, path, max_bytes=meta.anchor_bytes)
        except ObjectTooLarge:
            raise VersionError(f"{key}: payload is larger than meta.json says") from None
        if not _same(pulse.digest_file, path, meta.anchor_hash):
            raise VersionError(f"{key}: payload hash differs from meta.json")
        try:
            # Each tensor copied out of the file's mapping, which closes with
            # the file: tensors left on it would point at unmapped memory.
            with safe_open(path, framework="pt") as f:
                state = {name: f.get_tensor(name).clone() for name in f.keys()}  # noqa: SIM118
        except (SafetensorError, ValueError, OSError) as e:
            raise VersionError(f"{key}: not a readable safetensors file ({e})") from None
    if not _same(pulse.state_hash, state, meta.state_hash):
        raise VersionError(f"v{meta.version}: anchor does not hash to meta.json's state_hash")
    return state


class Follower:
    """Worker side: the newest published state, rebuilt and verified."""

    def __init__(self, store: ObjectStore, anchor_every: int, trust: Trust, in_place: bool = True):
        """in_place: patches rebuild the state inside its own tensors (no
        second copy of the state while applying; a patch that fails is undone
        first); whoever reads `state` must then copy what it keeps (the
        engines do). Off: each patch builds a new state beside the old."""
        self.store, self.anchor_every, self.in_place = store, anchor_every, in_place
        self.trust = trust
        self.state: dict[str, torch.Tensor] | None = None
        self.version: int | None = None
        self.state_hash: str | None = None
        self.bytes_read = 0
        self.anchors_read = 0  # a follower that keeps up reads none after its first
        self._known: VersionMeta | None = None

    def _meta(self, v: int) -> VersionMeta:
        return needed_meta(self.store, v, self.trust, self._known)

    def _from_anchor(self, target: VersionMeta) -> None:
        anchor = self._meta(target.anchor)
        self.state = load_full(self.store, anchor)
        self.version, self.state_hash = anchor.version, anchor.state_hash
        self.bytes_read += anchor.anchor_bytes
        self.anchors_read += 1
        self._patch_to(target.version)

    def _patch_to(self, target: int) -> None:
        """Patch forward to `target`: anchors are never read on the way."""
        while self.version < target:
            meta = self._meta(self.version + 1)
            key = keys.patch_key(meta.version)
            patch = _payload(self.store, key, meta.patch_bytes, meta.patch_hash)
            # apply() verifies the rebuilt state against the patch's own
            # hash; that hash must be the one meta.json promises.
            header = pulse.read_header(patch)
            if header["result_hash"] != meta.state_hash:
                raise VersionError(f"v{meta.version}: patch and meta.json disagree")
            # The hash we hold spares hashing the base again, if the patch
            # names its base with the same algorithm.
            known = self.state_hash
            if algo_of(known) != algo_of(header["base_hash"]):
                known = None
            state = pulse.apply(self.state, patch, base_hash=known, in_place=self.in_place)
            if self.in_place:
                # A rewritten tensor gets a new tensor object over the same
                # memory: whoever holds the old object (a worker telling which
                # tensors to load again) sees it changed, as after a copy.
                names = {e["name"] for e in header["tensors"]}
                state = {k: t.detach() if k in names else t for k, t in state.items()}
            self.state = state
            self.bytes_read += meta.patch_bytes
            self.version, self.state_hash = meta.version, meta.state_hash

    def sync(self, target: int | None = None, known: VersionMeta | None = None) -> bool:
        """Move to `target` (default: the newest version); True if the state changed.

        `known`: a meta.json already read (latest.json carries the newest), so
        a follower one version behind reads the patch and nothing else."""
        target = latest_version(self.store, self.trust) if target is None else target
        if target is None or target == self.version:
            return False
        self._known = known
        meta = self._meta(target)
        behind = None if self.version is None else target - self.version
        if behind is None or behind < 0 or behind > self.anchor_every:
            self._from_anchor(meta)
            return True
        try:
            self._patch_to(target)
        except (pulse.PatchError, VersionError, NotFound):
            self._from_anchor(meta)  # a bad patch: start over from the anchor
        return True
