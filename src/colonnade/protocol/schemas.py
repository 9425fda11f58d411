"""The JSON documents of protocol v1, validated on read and size-bounded.

Everything a worker sends is untrusted: `decode_batch` decompresses with a
hard output limit, checks every field's type and range, and raises
SchemaError with the first problem. Nothing here uses pickle or eval.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import zstandard

from colonnade import untrusted
from colonnade.pulse.hashing import is_hash

from .keys import PROTOCOL_VERSION, check_worker_id

MAX_JSON_BYTES = 1 << 20  # run.json, meta.json, heartbeats
MAX_BATCH_BYTES = 64 << 20  # a rollout batch, compressed and decompressed
MAX_EPISODES = 4096
FINISHES = ("done", "eos", "length")


class SchemaError(ValueError):
    """A document that does not match its schema (or is too large)."""


def _need(cond: bool, what: str) -> None:
    if not cond:
        raise SchemaError(what)


def _int(x: Any, lo: int = 0, hi: int = 1 << 62) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi


def _num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def loads(data: bytes, limit: int = MAX_JSON_BYTES) -> dict:
    """A JSON object from untrusted bytes, bounded in size and depth before
    parsing; SchemaError otherwise."""
    try:
        untrusted.check_json(data, limit)
        doc = json.loads(data)
    except ValueError as e:  # the bounds, JSONDecodeError, UnicodeDecodeError
        raise SchemaError(f"not a JSON document we accept: {e}") from None
    except RecursionError:  # a second net under the depth bound
        raise SchemaError("not a JSON document we accept: nested too deeply") from None
    _need(isinstance(doc, dict), "document is not a JSON object")
    return doc


def _same_fields(cls, d: dict, what: str) -> None:
    names = set(cls.__dataclass_fields__)
    _need(set(d) == names, f"{what} fields differ: {sorted(set(d) ^ names)}")


def dumps(doc: dict) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class RunSpec:
    """run.json: everything a worker needs to join, written once by the trainer."""

    run_id: str
    env: str
    env_kwargs: dict[str, Any]
    model_files: list[str]
    vocab_size: int
    precision: str  # of published weights: int8 | bf16
    group_size: int
    groups_per_batch: int  # per uploaded rollout batch
    max_lag: int
    anchor_every: int
    sampling: dict[str, Any]
    signed: bool = False  # rollout objects must carry a registered worker's signature
    protocol: int = PROTOCOL_VERSION
    # Groups the trainer takes per version; workers stop making more of a
    # version once the store holds that many. 0: unknown (run.json written
    # before this field existed, which is still read): no pacing.
    groups_per_step: int = 0

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> RunSpec:
        d = loads(data)
        _need(
            d.get("protocol") == PROTOCOL_VERSION,
            f"run.json speaks protocol {d.get('protocol')!r}; this colonnade speaks "
            f"{PROTOCOL_VERSION} (run it with the release that started the run)",
        )
        d = {"groups_per_step": 0, **d}  # absent from run.json files of earlier releases
        _same_fields(cls, d, "run.json")
        _need(isinstance(d["run_id"], str) and isinstance(d["env"], str), "run_id/env: strings")
        _need(isinstance(d["env_kwargs"], dict), "env_kwargs: object")
        _need(
            all(_num(v) or isinstance(v, str) for v in d["env_kwargs"].values()),
            "env_kwargs: scalar values only",
        )
        files = d["model_files"]
        _need(
            isinstance(files, list) and all(isinstance(f, str) and "/" not in f for f in files),
            "model_files: list of file names",
        )
        _need(d["precision"] in ("int8", "bf16"), "precision: int8 or bf16")
        for k in ("vocab_size", "group_size", "groups_per_batch", "anchor_every"):
            _need(_int(d[k], 1), f"{k}: positive integer")
        _need(_int(d["max_lag"], 0), "max_lag: integer >= 0")
        _need(_int(d["groups_per_step"], 0), "groups_per_step: integer >= 0")
        _need(isinstance(d["sampling"], dict), "sampling: object")
        _need(isinstance(d["signed"], bool), "signed: boolean")
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

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> VersionMeta:
        return cls.from_dict(loads(data))

    @classmethod
    def from_dict(cls, d: Any) -> VersionMeta:
        _need(isinstance(d, dict), "meta.json is not an object")
        _same_fields(cls, d, "meta.json")
        v = d["version"]
        _need(_int(v) and _int(d["anchor"], 0, v), "version/anchor")
        _need(is_hash(d["state_hash"]), "state_hash: blake3:<hex> or sha256:<hex>")
        for k in ("full_bytes", "patch_bytes", "anchor_bytes"):
            _need(_int(d[k]), f"{k}: integer >= 0")
        is_anchor = d["anchor"] == v
        _need(is_hash(d["anchor_hash"]) == is_anchor, "an anchor version, and only one, has a full")
        _need(is_anchor or d["anchor_hash"] == "", "anchor_hash: empty off anchors")
        _need(is_hash(d["patch_hash"]) == (v > 0), "every version but v0, and only those, patch")
        _need(v > 0 or d["patch_hash"] == "", "patch_hash: empty for v0")
        _need(_num(d["created"]), "created: number")
        return cls(**d)


@dataclass(frozen=True)
class Latest:
    """weights/latest.json: the newest version at a glance, rewritten by the
    trainer after each meta.json (a pointer: meta.json stays the truth).

    A worker polls this one object: it names the newest version and carries
    its meta.json (so a follower one version behind reads this and the patch,
    nothing else), says when the run is over, and counts the quarantine
    decisions (a worker rereads trainer/quarantine.json when the count grows).
    """

    version: int
    meta: VersionMeta
    done: bool = False  # the run is over (trainer/done.json is written too)
    quarantined: int = 0  # quarantine decisions so far

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> Latest:
        d = loads(data)
        _same_fields(cls, d, "latest.json")
        meta = VersionMeta.from_dict(d["meta"])
        _need(_int(d["version"]) and meta.version == d["version"], "version: its meta's")
        _need(isinstance(d["done"], bool) and _int(d["quarantined"]), "done/quarantined")
        return cls(d["version"], meta, d["done"], d["quarantined"])


@dataclass
class EpisodeRecord:
    """One episode as a worker saw it: generated tokens only (no prompt)."""

    tokens: list[int]
    from_model: list[bool]
    logprobs: list[float]  # behaviour log-prob per token; 0.0 on tool tokens
    finish: str


@dataclass
class GroupRecord:
    task_id: str
    episodes: list[EpisodeRecord]


@dataclass
class RolloutBatch:
    worker: str
    version: int
    seq: int
    groups: list[GroupRecord] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)  # informational only
    engine: str = "torch"  # which rollout engine made it (`torch`, `mlx`): the only trace of it


# Known names only: the trainer counts batches per engine, and a free-form
# name from a worker would grow that count table without bound.
ENGINES = ("torch", "mlx")
BATCH_FIELDS = {"worker", "version", "seq", "groups", "stats"}


def encode_batch(batch: RolloutBatch) -> bytes:
    doc = asdict(batch)
    for g in doc["groups"]:
        for e in g["episodes"]:
            e["from_model"] = "".join("1" if b else "0" for b in e["from_model"])
    return zstandard.ZstdCompressor(level=3).compress(dumps(doc))


def _episode(e: Any, vocab: int, max_tokens: int) -> EpisodeRecord:
    _need(
        isinstance(e, dict) and set(e) == {"tokens", "from_model", "logprobs", "finish"},
        "episode fields",
    )
    toks, mask, lps = e["tokens"], e["from_model"], e["logprobs"]
    _need(
        isinstance(toks, list) and 0 < len(toks) <= max_tokens,
        f"episode length must be 1..{max_tokens}",
    )
    _need(
        isinstance(mask, str) and len(mask) == len(toks) and set(mask) <= {"0", "1"},
        "from_model: 0/1 string as long as tokens",
    )
    _need(isinstance(lps, list) and len(lps) == len(toks), "logprobs as long as tokens")
    _need(all(_int(t, 0, vocab - 1) for t in toks), "token id out of the vocabulary")
    _need(all(_num(x) and -1e4 <= x <= 0.0 for x in lps), "logprobs: finite, <= 0")
    _need(mask[0] == "1", "an episode starts with a model token")
    _need(e["finish"] in FINISHES, f"finish: one of {FINISHES}")
    return EpisodeRecord(list(toks), [c == "1" for c in mask], [float(x) for x in lps], e["finish"])


def batch_bytes_bound(episodes: int, max_tokens: int) -> int:
    """The decompressed size a batch of `episodes` episodes of at most
    `max_tokens` tokens can need: a token id, its mask character and its
    log-prob take under 40 bytes of JSON. What a run asks of its workers
    bounds what the trainer will inflate and parse."""
    return min(MAX_BATCH_BYTES, episodes * max_tokens * 40 + (64 << 10))


def content_digest(group: GroupRecord, version: int) -> str:
    """The same episodes give the same digest however they are encoded,
    compressed, signed or named: the task, the policy version and every
    episode's token ids, in order."""
    h = hashlib.sha256(json.dumps([version, group.task_id]).encode())
    for e in group.episodes:
        ids = np.asarray(e.tokens, dtype=np.int64)
        h.update(np.int64(ids.size).tobytes())
        h.update(ids.tobytes())
    return h.hexdigest()


def decode_batch(
    data: bytes, vocab: int, max_tokens: int, max_raw: int = MAX_BATCH_BYTES
) -> RolloutBatch:
    """A validated batch from untrusted bytes, or SchemaError. `max_raw`
    bounds the decompressed JSON (see `batch_bytes_bound`)."""
    _need(len(data) <= MAX_BATCH_BYTES, "batch too large")
    try:
        raw = untrusted.decompress(data, max_raw)
    except ValueError as e:
        raise SchemaError(f"not a batch: {e}") from None
    d = loads(raw, max_raw)
    # `engine` is optional: batches from workers older than the field still parse.
    _need(set(d) in (BATCH_FIELDS, BATCH_FIELDS | {"engine"}), "batch fields")
    engine = d.get("engine", "torch")
    _need(isinstance(engine, str) and engine in ENGINES, f"engine name: one of {ENGINES}")
    try:
        check_worker_id(d["worker"])
    except (ValueError, TypeError):
        raise SchemaError("worker: invalid id") from None
    _need(_int(d["version"]) and _int(d["seq"]), "version/seq: integers")
    _need(isinstance(d["stats"], dict) and all(_num(v) for v in d["stats"].values()), "stats")
    groups = d["groups"]
    _need(isinstance(groups, list) and groups, "groups: non-empty list")
    # Counted before any episode is parsed, so a huge batch costs nothing.
    sizes = [
        len(e) for g in groups if isinstance(g, dict) and isinstance(e := g.get("episodes"), list)
    ]
    _need(sum(sizes) <= MAX_EPISODES, "too many episodes")
    out = []
    for g in groups:
        _need(isinstance(g, dict) and set(g) == {"task_id", "episodes"}, "group fields")
        _need(isinstance(g["task_id"], str) and 0 < len(g["task_id"]) <= 256, "task_id")
        _need(isinstance(g["episodes"], list) and g["episodes"], "episodes: non-empty list")
        out.append(
            GroupRecord(g["task_id"], [_episode(e, vocab, max_tokens) for e in g["episodes"]])
        )
    return RolloutBatch(d["worker"], d["version"], d["seq"], out, dict(d["stats"]), engine)
