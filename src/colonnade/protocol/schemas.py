"""The documents of the protocol, validated on read and size-bounded.

Documents are JSON; rollout batches are binary (protocol 3): zstd over
safetensors, token ids int32, log-probs float32, the from-model mask uint8,
the other fields as JSON in the safetensors metadata.

Everything a worker sends is untrusted: `decode_batch` decompresses with a
hard output limit, reads and checks the safetensors header itself (size,
nesting, names, dtypes, shapes, offsets that cover the data exactly) before
any tensor is read, checks every field's type and range, and raises
SchemaError with the first problem. Nothing here uses pickle or eval.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

import numpy as np
import zstandard

from colonnade import untrusted
from colonnade.choices import ENGINES, PUBLISHED_PRECISIONS
from colonnade.envs.args import check_env_kwargs
from colonnade.pulse.hashing import is_hash
from colonnade.tools.signed import Reply
from colonnade.untrusted import SchemaError, is_int, is_number, need

from .keys import MAX_SLOT, PROTOCOL_VERSION, check_worker_id

MAX_JSON_BYTES = 1 << 20  # run.json, meta.json, heartbeats
MAX_BATCH_BYTES = 64 << 20  # a rollout batch, compressed and decompressed
MAX_EPISODES = 4096
# tool: its tool service gave no reply; overflow: a tool reply would have
# passed the episode's token budget, so the episode ended unanswered
FINISHES = ("done", "eos", "length", "tool", "overflow")
MAX_TOOL_REPLIES = 256  # signed replies of one episode
MAX_REWARD = 1e6  # a worker's claimed reward, in size: the advantages divide by their spread


class ProtocolMismatch(SchemaError):
    """A document of another protocol version: run.json, or a worker's batch."""


def _mismatch(what: str, theirs: Any, hint: str) -> ProtocolMismatch:
    return ProtocolMismatch(
        f"{what} speaks protocol {repr(theirs)[:40]}; this colonnade speaks "
        f"{PROTOCOL_VERSION} ({hint})"
    )


_RUN_HINT = "run it with the release that started the run"
_WORKER_HINT = "its worker runs another release of colonnade"


def _unique(pairs: list) -> dict:
    names = [k for k, _ in pairs]
    if len(set(names)) != len(names):  # parsers disagree on which one counts
        raise SchemaError(f"a key appears twice: {sorted(k for k in names if names.count(k) > 1)}")
    return dict(pairs)


def loads(data: bytes, limit: int = MAX_JSON_BYTES, unique: bool = False) -> dict:
    """A JSON object from untrusted bytes, bounded in size and depth before
    parsing; SchemaError otherwise. `unique`: refuse a key twice in an object."""
    try:
        untrusted.check_json(data, limit)
        doc = json.loads(data, object_pairs_hook=_unique if unique else None)
    except SchemaError:
        raise
    except ValueError as e:  # the bounds, JSONDecodeError, UnicodeDecodeError
        raise SchemaError(f"not a JSON document we accept: {e}") from None
    except RecursionError:  # a second net under the depth bound
        raise SchemaError("not a JSON document we accept: nested too deeply") from None
    need(isinstance(doc, dict), "document is not a JSON object")
    return doc


def _same_fields(cls, d: dict, what: str) -> None:
    names = {f.name for f in fields(cls)}  # ClassVars aside
    need(set(d) == names, f"{what} fields differ: {sorted(set(d) ^ names)}")


def dumps(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class RunSpec:
    """run.json: everything a worker needs to join, written once by the
    trainer and signed by it (protocol 7: inside the signed envelope of
    `protocol.signing`, which carries the protocol version)."""

    run_id: str
    env: str
    env_kwargs: dict[str, Any]
    model_files: dict[str, str]  # file name under model/ -> hash of its bytes
    vocab_size: int
    precision: str  # of published weights: int8 | bf16
    group_size: int
    groups_per_batch: int  # per uploaded rollout batch
    max_lag: int
    anchor_every: int
    sampling: dict[str, Any]
    trainer_key: str  # the trainer's public key (hex): it signs what workers act on
    signed: bool = False  # rollout objects and claims must carry a registered worker's signature
    # Groups the trainer takes per version (workers pace by the demand; informational).
    groups_per_step: int = 0
    # Where workers write: "" for the `inbox/` folder of the run's store, else
    # a store URL of its own (a second bucket, docs/security.md).
    inbox: str = ""
    inbox_endpoint_url: str | None = None  # its S3 endpoint; None: the reader's own

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return dumps(self.to_dict())

    @classmethod
    def from_json(cls, data: bytes) -> RunSpec:
        return cls.from_dict(loads(data))

    @classmethod
    def from_dict(cls, d: Any) -> RunSpec:
        need(isinstance(d, dict), "run.json is not an object")
        _same_fields(cls, d, "run.json")
        need(isinstance(d["run_id"], str) and isinstance(d["env"], str), "run_id/env: strings")
        try:  # the check every side runs: JSON types, bounded
            check_env_kwargs(d["env_kwargs"])
        except ValueError as e:
            raise SchemaError(str(e)) from None
        files = d["model_files"]
        need(
            isinstance(files, dict)
            and all(isinstance(f, str) and "/" not in f and is_hash(h) for f, h in files.items()),
            "model_files: {file name: hash}",
        )
        need(
            d["precision"] in PUBLISHED_PRECISIONS,
            f"precision: {' or '.join(PUBLISHED_PRECISIONS)}",
        )
        for k in ("vocab_size", "group_size", "groups_per_batch", "anchor_every"):
            need(is_int(d[k], 1), f"{k}: positive integer")
        need(is_int(d["max_lag"], 0), "max_lag: integer >= 0")
        need(is_int(d["groups_per_step"], 0), "groups_per_step: integer >= 0")
        need(isinstance(d["sampling"], dict), "sampling: object")
        need(isinstance(d["signed"], bool), "signed: boolean")
        need(isinstance(d["trainer_key"], str) and len(d["trainer_key"]) == 64, "trainer_key: hex")
        need(isinstance(d["inbox"], str) and len(d["inbox"]) <= 1024, "inbox: a store URL or ''")
        ep = d["inbox_endpoint_url"]
        need(ep is None or (isinstance(ep, str) and len(ep) <= 1024), "inbox_endpoint_url")
        return cls(**d)


@dataclass(frozen=True)
class VersionMeta:
    """weights/{v}/meta.json, written last: a version exists once this does.

    Every version but v0 has a patch from the version before it, anchors
    included, so a worker that follows never downloads an anchor; anchor
    versions (v0 and every `anchor_every`-th) also hold the full state, for
    joiners and for the fallback after a damaged patch.
    """

    version: int
    anchor: int  # newest anchor at or below this version
    state_hash: str  # tree hash of the state a worker rebuilds (at the run's precision)
    full_bytes: int  # what a full checkpoint at this precision weighs
    created: float
    patch_bytes: int = 0  # weights/{v}/patch.pulse (from v - 1); 0 for v0
    patch_hash: str = ""  # of its bytes, e.g. "blake3:<hex>"; "" for v0
    anchor_bytes: int = 0  # weights/{v}/full.safetensors; 0 unless v is an anchor
    anchor_hash: str = ""  # of its bytes; "" unless v is an anchor

    @property
    def kind(self) -> str:
        """ "full" for an anchor version, else "patch"."""
        return "full" if self.anchor_bytes else "patch"

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> VersionMeta:
        return cls.from_dict(loads(data))

    @classmethod
    def from_dict(cls, d: Any) -> VersionMeta:
        need(isinstance(d, dict), "meta.json is not an object")
        _same_fields(cls, d, "meta.json")
        v = d["version"]
        need(is_int(v) and is_int(d["anchor"], 0, v), "version/anchor")
        need(is_hash(d["state_hash"]), "state_hash: blake3:<hex> or sha256:<hex>")
        for k in ("full_bytes", "patch_bytes", "anchor_bytes"):
            need(is_int(d[k]), f"{k}: integer >= 0")
        is_anchor = d["anchor"] == v
        need(is_hash(d["anchor_hash"]) == is_anchor, "an anchor version, and only one, has a full")
        need(is_anchor or d["anchor_hash"] == "", "anchor_hash: empty off anchors")
        need(is_hash(d["patch_hash"]) == (v > 0), "every version but v0, and only those, patch")
        need(v > 0 or d["patch_hash"] == "", "patch_hash: empty for v0")
        need(is_number(d["created"]), "created: number")
        return cls(**d)


@dataclass(frozen=True)
class Demand:
    """What the trainer still wants made, carried by latest.json (protocol 4).

    A worker running `version` may make a batch only after it has claimed one
    of the slots `claims/{version}/{0 .. slots-1}.json` (put-if-absent): the
    trainer opens as many slots as the groups its next steps will take, less
    what is already made or promised, plus a small surplus for stragglers
    (train/demand.py). Slots only ever grow for a version: a slot once opened
    stays open, and the count goes up when a claim expires or a batch is
    refused. Workers of other versions wait for the next latest.json.
    """

    version: int  # the version whose slots are open (the newest published, or about to be)
    slots: int  # claim slots of that version, numbered from 0; 0: nothing wanted now
    oldest: int  # batches made with versions below this are never trained on
    lease_seconds: float  # a claim older than this without its batch is given up

    @classmethod
    def from_dict(cls, d: Any) -> Demand:
        need(isinstance(d, dict), "demand is not an object")
        _same_fields(cls, d, "demand")
        need(is_int(d["version"]) and is_int(d["oldest"], 0, d["version"]), "demand version/oldest")
        need(is_int(d["slots"], 0, MAX_SLOT + 1), f"demand slots: 0 to {MAX_SLOT + 1}")
        need(is_number(d["lease_seconds"]) and d["lease_seconds"] > 0, "lease_seconds: > 0")
        return cls(**d)


MAX_VERSION_SECONDS = 86_400.0  # a day: beyond it the figure is not believed


@dataclass(frozen=True)
class Latest:
    """weights/latest.json: the newest version at a glance, rewritten by the
    trainer after each meta.json (a pointer: meta.json stays the truth).

    A worker polls this one object: it names the newest version and carries
    its meta.json (so a follower one version behind reads this and the patch,
    nothing else), the trainer's demand (so claiming work costs no extra
    read), says when the run is over, and counts the quarantine decisions (a
    worker rereads trainer/quarantine.json when the count grows). Rewritten
    within a version too, when the demand changes.
    """

    version: int
    meta: VersionMeta
    done: bool = False  # the run is over (trainer/done.json is written too)
    quarantined: int = 0  # quarantine decisions so far
    demand: Demand | None = None  # what workers may claim; None: nothing (yet)
    # The trainer's moving average of the time between versions (protocol 5):
    # a worker that has just joined paces its polls by it, before it has
    # seen two versions of its own. None until two versions were published.
    version_seconds: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> Latest:
        return cls.from_dict(loads(data))

    @classmethod
    def from_dict(cls, d: Any) -> Latest:
        need(isinstance(d, dict), "latest.json is not an object")
        _same_fields(cls, d, "latest.json")
        meta = VersionMeta.from_dict(d["meta"])
        need(is_int(d["version"]) and meta.version == d["version"], "version: its meta's")
        need(isinstance(d["done"], bool) and is_int(d["quarantined"]), "done/quarantined")
        demand = None if d["demand"] is None else Demand.from_dict(d["demand"])
        gap = d["version_seconds"]
        need(
            gap is None or (is_number(gap) and 0 <= gap <= MAX_VERSION_SECONDS),
            f"version_seconds: null or 0 to {MAX_VERSION_SECONDS}",
        )
        return cls(d["version"], meta, d["done"], d["quarantined"], demand, gap)


@dataclass
class EpisodeRecord:
    """One episode as a worker saw it: generated tokens only (no prompt)."""

    tokens: list[int]
    from_model: list[bool]
    logprobs: list[float]  # behaviour log-prob per token; 0.0 on tool tokens
    finish: str
    # Probability mass below each sampled token in token-id order: where its
    # draw's interval starts (`protocol.draws`); 0.0 on tool tokens.
    below: list[float] = field(default_factory=list)
    # Its tool service's signed replies, one per served turn, in order
    # (tools/signed.py); none where the environment answers itself.
    tools: list[Reply] = field(default_factory=list)


@dataclass
class GroupRecord:
    task_id: str
    episodes: list[EpisodeRecord]
    # The worker's reward of each episode (protocol 9), sent only for an
    # environment whose episodes the trainer cannot replay; None otherwise.
    # The trainer uses it only under its trust rule (train/trust.py).
    rewards: list[float] | None = None


@dataclass
class RolloutBatch:
    worker: str
    version: int
    seq: int
    groups: list[GroupRecord] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # informational only
    engine: str = "torch"  # which rollout engine made it (`torch`, `mlx`): the only trace of it
    slot: int = 0  # the claim (version, slot) it fulfils: its tasks and draws follow from it


# Known names only: the trainer counts batches per engine, and a free-form
# name from a worker would grow that count table without bound.
BATCH_FIELDS = {"protocol", "worker", "version", "seq", "slot", "engine", "stats", "groups",
                "tools"}  # fmt: skip
META_KEY = "colonnade"  # the one entry of the safetensors metadata: the batch's JSON fields
# name -> (safetensors dtype, numpy dtype); every tensor is one-dimensional.
TENSORS = {
    "tokens": ("I32", np.dtype("<i4")),  # every episode's token ids, end to end
    "logprobs": ("F32", np.dtype("<f4")),  # behaviour log-prob per token
    "below": ("F32", np.dtype("<f4")),  # mass below each sampled token (its draw's interval)
    "from_model": ("U8", np.dtype("u1")),  # 1: generated by the model, 0: the environment's
    "lengths": ("I32", np.dtype("<i4")),  # tokens per episode, in order
}
TOKEN_BYTES = sum(dt.itemsize for name, (_, dt) in TENSORS.items() if name != "lengths")
# Room for a tool service's signed replies, per token of an episode: a
# result, its call and signature, escaped twice (they are metadata JSON).
REPLY_BYTES = 32
EPISODE_BYTES = 64  # an episode's length, finish and reward (protocol 9), escaped
GROUP_BYTES = 4 << 10  # a group's task id, escaped in the metadata JSON and again in the header
HEADER_SLACK = 64 << 10  # the tensors' entries, worker, stats and the rest


def pack_batch(batch: RolloutBatch) -> bytes:
    """The batch as safetensors bytes (uncompressed): token ids int32, log-probs
    float32, the from-model mask uint8 and episode lengths int32, every
    episode end to end; the other fields as JSON in the metadata."""
    from safetensors.numpy import save

    eps = [e for g in batch.groups for e in g.episodes]
    ids = np.concatenate([np.asarray(e.tokens, dtype=np.int64) for e in eps] or [[]])
    if ids.size and (ids.min() < 0 or ids.max() > np.iinfo(np.int32).max):
        raise ValueError("token ids must fit in int32")
    tensors = {
        "tokens": ids.astype("<i4"),
        "logprobs": np.concatenate(
            [np.asarray(e.logprobs, dtype=np.float64) for e in eps] or [[]]
        ).astype("<f4"),
        "below": np.concatenate([_below(e) for e in eps] or [[]]).astype("<f4"),
        "from_model": np.concatenate(
            [np.asarray(e.from_model, dtype=bool) for e in eps] or [[]]
        ).astype(np.uint8),
        "lengths": np.asarray([len(e.tokens) for e in eps], dtype="<i4"),
    }
    meta = {
        "protocol": PROTOCOL_VERSION,
        "worker": batch.worker,
        "version": batch.version,
        "seq": batch.seq,
        "slot": batch.slot,
        "engine": batch.engine,
        "stats": batch.stats,
        "tools": _tools_fields(batch),
        "groups": [_group_fields(g) for g in batch.groups],
    }
    return save(tensors, metadata={META_KEY: dumps(meta).decode()})


def _group_fields(g: GroupRecord) -> dict:
    out: dict[str, Any] = {"task_id": g.task_id, "finish": [e.finish for e in g.episodes]}
    if g.rewards is not None:
        if len(g.rewards) != len(g.episodes):
            raise ValueError("rewards: one per episode")
        out["rewards"] = [float(r) for r in g.rewards]
    return out


def _tools_fields(batch: RolloutBatch) -> list:
    """The signed replies, per group and episode; [] when no episode has one."""
    if not any(e.tools for g in batch.groups for e in g.episodes):
        return []
    return [[[r.to_dict() for r in e.tools] for e in g.episodes] for g in batch.groups]


def _replies(tools: Any, groups: list) -> list[list[list[Reply]]]:
    """The batch's signed replies per group and episode, shapes and sizes checked
    (their signatures are the trainer's to check: train/replies.py)."""
    need(isinstance(tools, list), "tools: a list")
    if not tools:
        return [[[] for _ in g["finish"]] for g in groups]
    need(len(tools) == len(groups), "tools: one list per group")
    out = []
    for per, g in zip(tools, groups, strict=True):
        need(isinstance(per, list) and len(per) == len(g["finish"]), "tools: a list an episode")
        need(all(isinstance(r, list) and len(r) <= MAX_TOOL_REPLIES for r in per),
             f"tools: at most {MAX_TOOL_REPLIES} replies an episode")  # fmt: skip
        out.append([[Reply.from_dict(r) for r in replies] for replies in per])
    return out


def _below(e: EpisodeRecord) -> np.ndarray:
    if len(e.below) not in (0, len(e.tokens)):
        raise ValueError("below: one value per token, or none (all 0.0)")
    return np.asarray(e.below or [0.0] * len(e.tokens), dtype=np.float64)


def encode_batch(batch: RolloutBatch) -> bytes:
    """What a worker uploads (before signing): `pack_batch`, zstd-compressed."""
    return zstandard.ZstdCompressor(level=3).compress(pack_batch(batch))


def batch_bytes_bound(episodes: int, max_tokens: int, groups: int | None = None) -> int:
    """The decompressed size a batch of `episodes` episodes of at most
    `max_tokens` tokens, in `groups` groups (default: one an episode), can
    need: 13 bytes a token (int32 id, float32 log-prob and mass below, uint8
    mask), 64 bytes an episode (its length, finish and reward), 4 KiB a group (a task
    id of 256 characters, escaped twice) and 64 KiB for the rest of the header. What a
    run asks of its workers bounds what the trainer will inflate and parse;
    REPLY_BYTES more a token make room for a tool service's signed replies."""
    groups = episodes if groups is None else groups
    per_token = TOKEN_BYTES + REPLY_BYTES
    need = episodes * (max_tokens * per_token + EPISODE_BYTES) + groups * GROUP_BYTES
    return min(MAX_BATCH_BYTES, need + HEADER_SLACK)


def content_digest(group: GroupRecord) -> str:
    """The same episodes give the same digest however they are encoded,
    compressed, signed, named or labelled: the task and every episode's
    token ids, in order. Not the version: episodes already trained and
    labelled with a newer version are the same episodes."""
    h = hashlib.sha256(json.dumps(["group", group.task_id]).encode())
    for e in group.episodes:
        ids = np.asarray(e.tokens, dtype=np.int64)
        h.update(np.int64(ids.size).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


def decode_batch(
    data: bytes, vocab: int, max_tokens: int, max_raw: int = MAX_BATCH_BYTES
) -> RolloutBatch:
    """A validated batch from untrusted bytes, or SchemaError (ProtocolMismatch
    for a batch of another protocol version). `max_raw` bounds the
    decompressed bytes (see `batch_bytes_bound`)."""
    need(len(data) <= MAX_BATCH_BYTES, "batch too large")
    try:
        frame = untrusted.zstd_frame_size(data)
        raw = untrusted.decompress(data, max_raw, require_size=True)
    except ValueError as e:
        raise SchemaError(f"not a batch: {e}") from None
    need(frame == len(data), f"{len(data) - frame} bytes of trailing data after the zstd frame")
    return unpack_batch(raw, vocab, max_tokens)


def _header(raw: bytes) -> tuple[dict, dict]:
    """(tensor entries, the batch's JSON fields, where the data starts) of
    safetensors bytes, every entry checked against TENSORS and the data
    covered exactly, before anything else reads them."""
    need(len(raw) >= 8, f"not a batch: {len(raw)} bytes, no safetensors header")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8 and raw[:1] == b"{":  # a JSON batch of earlier releases
        raise _mismatch("a JSON batch", 2, _WORKER_HINT)
    need(n <= len(raw) - 8, f"header of {n} bytes, but {len(raw) - 8} bytes follow")
    # Size and depth bounded before parsing; a key twice would let safetensors
    # read another entry than the one checked here.
    head = loads(raw[8 : 8 + n], n, unique=True)
    need(set(head) == {"__metadata__", *TENSORS}, f"tensors: {sorted(set(TENSORS))}")
    meta = head["__metadata__"]
    need(isinstance(meta, dict) and set(meta) == {META_KEY}, f"metadata: {META_KEY!r} only")
    need(isinstance(meta[META_KEY], str), "metadata: a JSON string")
    fields = loads(meta[META_KEY].encode(), n, unique=True)
    spans = []
    for name, (dtype, np_dtype) in TENSORS.items():
        t = head[name]
        need(isinstance(t, dict) and set(t) == {"dtype", "shape", "data_offsets"}, name)
        need(t["dtype"] == dtype, f"{name}: dtype {dtype}, not {t['dtype']!r}")
        shape, offsets = t["shape"], t["data_offsets"]
        need(isinstance(shape, list) and len(shape) == 1 and is_int(shape[0], 0, 1 << 40),
             f"{name}: one dimension")  # fmt: skip
        need(isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets)),
             f"{name}: data_offsets")  # fmt: skip
        need(offsets[1] - offsets[0] == shape[0] * np_dtype.itemsize,
             f"{name}: data_offsets disagree with its shape")  # fmt: skip
        spans.append(offsets)
    end = 0
    for a, b in sorted(spans):
        need(a == end, "tensor data overlaps or leaves a gap")
        end = b
    body = len(raw) - 8 - n
    need(end == body, f"tensor data ends at {end} of {body} bytes (trailing data)")
    return head, fields


def unpack_batch(raw: bytes, vocab: int, max_tokens: int) -> RolloutBatch:
    """A validated batch from uncompressed untrusted bytes (`pack_batch`'s)."""
    from safetensors import SafetensorError
    from safetensors.numpy import load

    head, d = _header(raw)
    need("protocol" in d, "batch fields: no protocol")
    if not (is_int(d["protocol"]) and d["protocol"] == PROTOCOL_VERSION):
        raise _mismatch("the batch", d["protocol"], _WORKER_HINT)
    need(set(d) == BATCH_FIELDS, f"batch fields differ: {sorted(set(d) ^ BATCH_FIELDS)}")
    need(isinstance(d["engine"], str) and d["engine"] in ENGINES, f"engine name: one of {ENGINES}")
    try:
        check_worker_id(d["worker"])
    except (ValueError, TypeError):
        raise SchemaError("worker: invalid id") from None
    need(is_int(d["version"]) and is_int(d["seq"]), "version/seq: integers")
    need(is_int(d["slot"], 0, MAX_SLOT), f"slot: an integer 0..{MAX_SLOT}")
    need(isinstance(d["stats"], dict) and all(is_number(v) for v in d["stats"].values()), "stats")
    groups = d["groups"]
    need(isinstance(groups, list) and groups, "groups: non-empty list")
    for g in groups:
        need(isinstance(g, dict) and set(g) - {"rewards"} == {"task_id", "finish"}, "group fields")
        need(isinstance(g["task_id"], str) and 0 < len(g["task_id"]) <= 256, "task_id")
        need(isinstance(g["finish"], list) and g["finish"], "finish: a non-empty list")
        need(all(isinstance(f, str) and f in FINISHES for f in g["finish"]),
             f"finish: one of {FINISHES}")  # fmt: skip
        rewards = g.get("rewards")
        need(rewards is None or (isinstance(rewards, list) and len(rewards) == len(g["finish"])
             and all(is_number(r) and abs(r) <= MAX_REWARD for r in rewards)),
             f"rewards: one finite number per episode, at most {MAX_REWARD:g} in size")  # fmt: skip
    replies = _replies(d["tools"], groups)
    episodes = sum(len(g["finish"]) for g in groups)
    need(episodes <= MAX_EPISODES, "too many episodes")
    shapes = {name: head[name]["shape"][0] for name in TENSORS}
    need(shapes["lengths"] == episodes, "lengths: one per episode")
    total = shapes["tokens"]
    need(shapes["logprobs"] == shapes["below"] == shapes["from_model"] == total,
         "logprobs, below and from_model as long as tokens")  # fmt: skip
    need(total <= episodes * max_tokens, f"episode length must be 1..{max_tokens}")
    try:
        arrays = load(raw)
    except (SafetensorError, ValueError) as e:  # checked above: a second net
        raise SchemaError(f"not a safetensors batch: {e}") from None
    for name, (_, np_dtype) in TENSORS.items():  # a second net: what was read is what was checked
        a = arrays.get(name)
        need(a is not None and a.dtype == np_dtype and a.shape == (shapes[name],),
             f"{name}: read back unlike its header")  # fmt: skip
    lengths = arrays["lengths"].astype(np.int64)
    need(bool(np.all((lengths >= 1) & (lengths <= max_tokens))),
         f"episode length must be 1..{max_tokens}")  # fmt: skip
    need(int(lengths.sum()) == total, "episode lengths do not add up to the tokens")
    toks, lps, mask = arrays["tokens"], arrays["logprobs"], arrays["from_model"]
    need(bool(np.all((toks >= 0) & (toks < vocab))), "token id out of the vocabulary")
    need(bool(np.all(np.isfinite(lps) & (lps >= -1e4) & (lps <= 0.0))), "logprobs: finite, <= 0")
    need(bool(np.all(mask <= 1)), "from_model: 0 or 1")
    below = arrays["below"]
    need(bool(np.all(np.isfinite(below) & (below >= 0.0) & (below <= 1.0))), "below: 0 to 1")
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    need(bool(np.all(mask[starts] == 1)), "an episode starts with a model token")
    cuts = np.cumsum(lengths)[:-1]
    ids, probs, under, model = (np.split(a, cuts) for a in (toks, lps, below, mask.astype(bool)))
    out, i = [], 0
    for g in groups:
        eps = []
        for finish in g["finish"]:
            eps.append(EpisodeRecord(ids[i].tolist(), model[i].tolist(), probs[i].tolist(), finish,
                                     under[i].tolist()))  # fmt: skip
            i += 1
        out.append(GroupRecord(g["task_id"], eps, g.get("rewards")))
    for group, per in zip(out, replies, strict=True):
        for ep, signed in zip(group.episodes, per, strict=True):
            ep.tools = signed
    return RolloutBatch(d["worker"], d["version"], d["seq"], out, dict(d["stats"]), d["engine"],
                        d["slot"])  # fmt: skip
