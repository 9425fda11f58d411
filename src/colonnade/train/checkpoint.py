"""Trainer checkpoints in the store, sharded with torch.distributed.checkpoint.

A checkpoint of version v is `trainer/checkpoints/{v}/`: one safetensors
shard per rank and `state.json`, which rank 0 writes last, with
put-if-absent, once every rank's shard is up; a checkpoint without it is
ignored. state.json is signed by the trainer and holds each shard's size
and hash (each rank hashes its own and leaves the hash beside the shard):
a resume takes only a checkpoint whose state verifies and whose shards
hash as it says, and falls back to an older one otherwise. Shards are
DCP's HuggingFace storage format: each rank's slices of every tensor, the
slices' offsets in the file's JSON header. No pickle anywhere (DCP's
default format pickles its metadata), so a checkpoint is data, never code.

What is saved: the fp32 master weights and AdamW's moments and step
counts; of a LoRA run, the adapters and their moments alone (the frozen
base is the model's own files). Not the learning rate, which the trainer sets every step from the
version. Loading reads whatever slices each rank needs from every shard, so
a run resumes on any number of ranks: DCP reshards (tested 2 ranks → 1).

Every rank writes its shard to a local staging folder (on a GPU the step
waits only for a copy to host memory, DCP's `async_save` writing from its
own thread; on a CPU, where that copy would double the state in the memory
the step needs, for the write) and uploads it in the background while the
next steps train (`put_file`: streamed, multipart when large), then leaves a
marker `rank-{r}.json`; rank 0 commits state.json once every rank's marker
is up. One checkpoint uploads at a time: the next save first waits for the
one in flight, so the staging folder needs room for two. A trainer that
stops waits for the upload (`finish`); one that crashes leaves a checkpoint
without state.json, which a resume ignores. On resume the first process of
each machine downloads the shards once for the ranks beside it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import re
import shutil
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from colonnade.background import Background
from colonnade.progress import Transfer
from colonnade.protocol import keys
from colonnade.protocol.schemas import SchemaError, loads
from colonnade.protocol.signing import Signer, Trust, read_envelope
from colonnade.pulse.hashing import digest_file
from colonnade.store import NotFound, ObjectStore, StoreError
from colonnade.store.retry import retry_unavailable

from .distributed import Dist
from .policy import PREFIX

log = logging.getLogger("colonnade.trainer")
# DCP warns on every save and load without a process group, which is how one
# process is meant to use it; `async_save` warns from its own thread, where
# `_single_process_quiet` does not reach.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")
STATE = keys.CHECKPOINT_STATE
FORMAT = "dcp-safetensors-1"


def init_adam_state(opt: torch.optim.Optimizer) -> None:
    """Give every parameter AdamW's state as a fresh optimizer would hold it
    after zero steps. DCP needs allocated tensors to save and load; its own
    initialisation takes a zero-gradient step, which counts as a step in
    Adam's bias correction and would halve the run's first real update."""
    for group in opt.param_groups:
        for p in group["params"]:
            if p.requires_grad and not opt.state.get(p):
                opt.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }


def _state_dicts(policy, opt, aliases: dict[str, str]) -> tuple[dict, list]:
    """({"model": …, "optim": …} of DCP-shardable tensors, AdamW's param groups)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    init_adam_state(opt)
    # Frozen parameters (a LoRA run's base) come from the model's own files.
    options = StateDictOptions(ignore_frozen_params=True)
    model_sd, optim_sd = get_state_dict(policy, opt, options=options)
    # A tied head is one parameter under two names: saved once.
    model_sd = {k: v for k, v in model_sd.items() if k.removeprefix(PREFIX) not in aliases}
    return {"model": model_sd, "optim": optim_sd["state"]}, optim_sd["param_groups"]


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every save and load without a process group, which is
    how one process is meant to use it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def staging_dir(root: Path, store: ObjectStore, what: str) -> Path:
    """A local folder named by the store and `what`: the same on every rank
    of a machine, different for different runs."""
    tag = hashlib.sha256(store.url.encode()).hexdigest()[:12]
    return Path(root) / f"{tag}-{what}"


@dataclass
class Checkpointer:
    """What a checkpoint is made of and where it goes, for every rank."""

    store: ObjectStore
    policy: object  # the Policy (FSDP-sharded or not)
    opt: torch.optim.Optimizer
    where: Dist
    staging: Path  # a local folder with room for one checkpoint
    aliases: dict[str, str]  # tied parameter names, saved once
    signer: Signer | None = None  # rank 0's: signs state.json
    keep: int = 0  # complete checkpoints rank 0 keeps once one commits (0: all)
    outage_seconds: float = 600.0  # how long an upload waits out an unavailable store
    ranks_seconds: float = 3600.0  # how long rank 0 waits for every rank's shards
    uploads: Background = field(default_factory=lambda: Background("checkpoint"))
    # DCP's async_save: the state copied to host memory, written from DCP's
    # thread. On a GPU the copy costs host memory the step does not use; on a
    # CPU it doubles the weights' and moments' share of the one memory the
    # step needs (a 0.6B model on 2 CPU ranks ran out), so the write waits.
    background_write: bool = False
    # The background write coordinates the ranks on a group of its own: on
    # the training's group its collectives would interleave with a step's.
    _group: object = None

    def __post_init__(self) -> None:
        if self.where.sharded and self.background_write:
            import torch.distributed as dist

            self._group = dist.new_group(backend="gloo")  # collective: every rank, once

    def save(self, version: int, facts: dict | None = None) -> float:
        """Collective: every rank copies its state, then writes its shard
        locally and uploads it in the background; rank 0 commits once all are
        up. The seconds this call waited for the previous checkpoint's
        upload."""
        import torch.distributed.checkpoint as dcp

        blocked = self.uploads.wait()
        store, where, staging = self.store, self.where, self.staging
        sd, _ = _state_dicts(self.policy, self.opt, self.aliases)
        local = staging_dir(staging, store, f"save-{version:08d}-rank{where.rank}")
        shutil.rmtree(local, ignore_errors=True)
        writer = dcp.HuggingFaceStorageWriter(str(local), save_distributed=True)
        written = None
        with _single_process_quiet():
            if self.background_write:
                # The state is copied to host memory here; the write to disk
                # runs in DCP's thread while the next steps train.
                written = dcp.async_save(
                    sd, storage_writer=writer, no_dist=not where.sharded, process_group=self._group
                )
            else:
                dcp.save(sd, storage_writer=writer, no_dist=not where.sharded)

        def upload() -> None:
            if written is not None:
                written.result()
            self._upload(version, local, facts)

        self.uploads.submit(upload)
        return blocked

    def finish(self) -> None:
        """Until the checkpoint in flight is up (and on rank 0 committed)."""
        self.uploads.wait()

    def _upload(self, version: int, local: Path, facts: dict | None) -> None:
        store, where = self.store, self.where
        prefix = keys.checkpoint_dir(version)
        files = sorted(local.glob("*.safetensors"))

        def put_all() -> None:
            for f in files:
                with Transfer(log.info, f"checkpoint v{version}: uploading {f.name}",
                              f.stat().st_size):  # fmt: skip
                    store.put_file(prefix + f.name, f)
                digest = {"bytes": f.stat().st_size, "hash": digest_file(f, HASH)}
                store.put(prefix + f.name + HASH_SUFFIX, json.dumps(digest).encode())
            names = json.dumps(sorted(f.name for f in files)).encode()
            store.put(prefix + f"rank-{where.rank:05d}.json", names)

        what = f"checkpoint v{version} upload"
        retry_unavailable(log, what, put_all, self.outage_seconds)
        shutil.rmtree(local, ignore_errors=True)
        if where.leader:
            retry_unavailable(log, what, lambda: self._commit(version, facts), self.outage_seconds)

    def _commit(self, version: int, facts: dict | None) -> None:
        """state.json, once every rank's marker is up; then older checkpoints pruned."""
        store, where = self.store, self.where
        prefix = keys.checkpoint_dir(version)
        deadline = time.monotonic() + self.ranks_seconds
        while True:
            listed = store.list(prefix)
            done = [k for k in listed if _RANK_MARKER.fullmatch(k.rsplit("/", 1)[1])]
            if len(done) >= where.world:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(
                    f"checkpoint v{version}: {len(done)} of {where.world} ranks' shards arrived "
                    f"in {self.ranks_seconds:.0f} s; not committed"
                )
            time.sleep(0.2)
        names = [k.rsplit("/", 1)[1] for k in listed if k.endswith(".safetensors")]
        shards = {name: _shard_digest(store, prefix + name) for name in names}
        doc = {**(facts or {}), "version": version, "format": FORMAT, "ranks": where.world,
               "shards": shards}  # fmt: skip
        key = keys.checkpoint_state_key(version)
        store.put_if_absent(key, self.signer.seal(key, doc))
        if self.keep > 0:
            prune_checkpoints(store, self.keep)

    def load(self, version: int) -> dict:
        """Collective: restore weights and AdamW state in place; the saved state.json."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        store, where, staging = self.store, self.where, self.staging
        # Rank 0 chose this checkpoint because its state verified; ranks on
        # other machines may hold no copy of the key and take its word.
        state = read_state(store, version, self.signer.trust if self.signer else None)
        local = staging_dir(staging, store, f"load-{version:08d}")
        if where.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
            fetch_shards(store, version, state, local)
        where.barrier()
        sd, groups = _state_dicts(self.policy, self.opt, self.aliases)
        reader = dcp.HuggingFaceStorageReader(str(local))
        with _single_process_quiet():
            dcp.load(sd, storage_reader=reader, no_dist=not where.sharded)
        # strict=False: only the tied head's second name is absent, on purpose.
        set_state_dict(
            self.policy,
            self.opt,
            model_state_dict=sd["model"],
            optim_state_dict={"state": sd["optim"], "param_groups": groups},
            options=StateDictOptions(strict=False),
        )
        where.barrier()
        if where.local_rank == 0:
            shutil.rmtree(local, ignore_errors=True)
        if state["ranks"] != where.world:
            log.info("checkpoint v%d: saved by %d ranks, resharded to %d", version,
                     state["ranks"], where.world)  # fmt: skip
        return state


HASH = "blake3"
HASH_SUFFIX = ".hash.json"  # beside each shard: its size and hash, from the rank that wrote it
_RANK_MARKER = re.compile(r"rank-[0-9]{5}\.json")  # a rank's shards are all up


class CheckpointError(RuntimeError):
    """A checkpoint that is incomplete, not the trainer's, or damaged."""


def _shard_digest(store: ObjectStore, key: str) -> dict:
    doc = loads(store.get(key + HASH_SUFFIX, max_bytes=4096))
    return {"bytes": int(doc["bytes"]), "hash": str(doc["hash"])}


def fetch_shards(store: ObjectStore, version: int, state: dict, local: Path) -> None:
    """Download a checkpoint's shards into `local`, each checked against state.json."""
    for name, want in state["shards"].items():
        path = local / name
        with Transfer(log.info, f"checkpoint v{version}: downloading {name}", want["bytes"]):
            store.get_file(keys.checkpoint_dir(version) + name, path, max_bytes=want["bytes"])
        if digest_file(path, HASH) != want["hash"]:
            raise CheckpointError(f"checkpoint v{version}: {name} does not hash as state.json says")


def checkpoints(store: ObjectStore) -> list[int]:
    """Versions with a state.json, newest first (verified or not)."""
    found = (keys.parse_checkpoint_key(k) for k in store.list(keys.CHECKPOINTS))
    return sorted({p[0] for p in found if p is not None and p[1] == STATE}, reverse=True)


def latest_checkpoint(store: ObjectStore, trust: Trust) -> int | None:
    """The newest checkpoint whose state.json the trainer signed; one that does
    not verify is named in one warning and passed over."""
    for v in checkpoints(store):
        try:
            read_state(store, v, trust)
            return v
        except CheckpointError as e:
            log.warning("%s; an older checkpoint is used (delete %s to silence this)", e,
                        keys.checkpoint_dir(v))  # fmt: skip
    return None


def read_state(store: ObjectStore, version: int, trust: Trust | None) -> dict:
    """A checkpoint's state.json; its signature checked against `trust`
    (None: taken as it is). CheckpointError otherwise."""
    key = keys.checkpoint_state_key(version)
    try:
        data = store.get(key, max_bytes=1 << 20)
        env = read_envelope(data, key)
        state = trust.open(key, data) if trust is not None else env["doc"]
    except NotFound:
        raise CheckpointError(f"checkpoint v{version} is incomplete (no {STATE})") from None
    except (SchemaError, StoreError) as e:
        raise CheckpointError(
            f"checkpoint v{version}: {STATE} is not the trainer's ({e})"
        ) from None
    if state.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint v{version} is in format {state.get('format', 'unsharded-1')!r}; this "
            f"trainer reads {FORMAT!r} (written by colonnade since the FSDP2 trainer)"
        )
    shards = state.get("shards")
    ok = isinstance(shards, dict) and all(
        isinstance(d, dict) and isinstance(d.get("bytes"), int) and isinstance(d.get("hash"), str)
        for d in shards.values()
    )
    if not ok or not isinstance(state.get("ranks"), int):
        raise CheckpointError(f"checkpoint v{version}: {STATE} lists no shards it can load")
    return state


def prune_checkpoints(store: ObjectStore, keep: int) -> int:
    """Delete all but the newest `keep` complete checkpoints (and any older
    incomplete ones); how many were removed."""
    found = (keys.parse_checkpoint_key(k) for k in store.list(keys.CHECKPOINTS))
    done = sorted({p[0] for p in found if p is not None})
    complete = [v for v in done if store.exists(keys.checkpoint_state_key(v))]
    if keep < 1 or len(complete) <= keep:
        return 0
    cutoff = complete[-keep]
    removed = 0
    for v in (v for v in done if v < cutoff):
        prefix = keys.checkpoint_dir(v)
        # state.json first: a half-deleted checkpoint is then ignored, never loaded.
        store.delete(keys.checkpoint_state_key(v))
        for k in store.list(prefix):
            store.delete(k)
        removed += 1
    return removed
