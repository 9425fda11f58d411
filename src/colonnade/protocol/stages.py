"""Messages between pipeline stages, packed and checked like any stranger's object.

A model cut into stages (`engine/stages.py`) runs as stage-workers in a
line; each step of a micro-batch passes once down the line and its sampled
tokens come back from the last stage to the first. Every message is
safetensors bytes: its fields as JSON in the one metadata entry
`colonnade`, its arrays as tensors. Two kinds:

- `Step`, stage K to K+1: the published version the micro-batch runs
  (every stage runs the same one: a later stage catches up to it, or
  refuses it if it already runs a newer one), the cache cuts the first stage made since the
  micro-batch's last step (`ops`, replayed in order on every stage's own
  cache of its layers), the cache the step runs on, the step's block
  (`positions` [B, W], `allowed` [B, 1, W, K] or none for plain causal
  attention, `real` [B, K]: which cache columns are real tokens, for
  windowed layers), the hidden states [B, W, hidden] (float32) and, for a
  step whose next token is sampled, the draws [B] and the distribution;
- `Sampled`, the last stage to the first: the tokens [B], their log-probs
  and the mass below each (`engine/sampling.py`); empty for a step that
  samples nothing (a prefill), which the first stage awaits all the same.

Each carries its binding (run, group, stage, batch, stream, seq): the
reader states what it expects next and refuses anything else, so a stale,
replayed or misdirected message is an error, not a step. `unpack` reads
the safetensors header itself (names, dtypes, shapes, offsets that cover
the data exactly) before any array is read, bounds every count, and checks
the values (positions, draws in [0, 1), finite hidden states, token ids in
the vocabulary); cache indices are checked against the caches when the
ops are replayed (`rollout/pipeline.py`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from colonnade.untrusted import SchemaError, is_int, is_number, need

from .keys import PROTOCOL_VERSION
from .schemas import loads

MAX_STAGE_BYTES = 256 << 20  # one message: a long prefill of many rows
MAX_ROWS = 4096  # rows of a micro-batch
MAX_COLUMNS = 1 << 17  # cache columns of a row
MAX_POSITION = 1 << 24
MAX_OPS = 4096  # cache cuts between two steps
MAX_CACHE_ID = 1 << 30
META_KEY = "colonnade"
MAX_FIELD = 256  # run and group names
MAX_VERSION = (1 << 31) - 1

# Cache cuts (`engine.backend.Cache`), as the first stage's cache made them.
# name -> the dimensions of its index array (None: it has none).
OPS = {
    "new": None,  # a: rows
    "free": None,
    "rows": 1,  # into `other` (a new cache): copies of rows `index`, without `a` columns
    "select": 1,  # rows `index`, without the first `a` columns
    "write": 1,  # `other`'s columns into rows `index` from column `a`
    "append": 1,  # `a` new columns: `other`'s last for rows `index`, pad for the rest
    "join": None,  # `other`'s rows after these, padded by `a` and `b` columns
    # The rows of the caches index[:, 0] after these, in order, all in one
    # buffer: these padded by `a` columns, each other by index[:, 1].
    "stack": 2,
    "gather": 2,  # columns index[b] of each row b
}
_SAFE = {  # numpy dtype -> safetensors dtype
    np.dtype("<f4"): "F32",
    np.dtype("<f8"): "F64",
    np.dtype("<i8"): "I64",
    np.dtype("bool"): "BOOL",
}


@dataclass(frozen=True)
class Binding:
    """Which message a reader expects: of this run and group, from stage
    `stage` (0-based), step `seq` of micro-batch `stream` of batch `batch`."""

    run: str
    group: str
    stage: int
    batch: int
    stream: int
    seq: int

    def fields(self) -> dict:
        return {"run": self.run, "group": self.group, "stage": self.stage,
                "batch": self.batch, "stream": self.stream, "seq": self.seq}  # fmt: skip


@dataclass
class Op:
    name: str
    cache: int
    other: int = -1
    a: int = 0
    b: int = 0
    index: np.ndarray | None = None


@dataclass
class Step:
    binding: Binding
    cache: int
    ops: list[Op]
    hidden: np.ndarray  # [B, W, H] float32
    positions: np.ndarray  # [B, W] int64
    real: np.ndarray  # [B, K] bool
    allowed: np.ndarray | None = None  # [B, 1, W, K] bool
    draws: np.ndarray | None = None  # [B] float64: sample this step
    distribution: tuple[float, int, float] | None = None  # temperature, top_k, top_p
    version: int = 0  # the published version every stage runs this step with


@dataclass
class Sampled:
    binding: Binding
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    logprobs: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    below: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float64))


def _save(tensors: dict[str, np.ndarray], fields: dict) -> bytes:
    from safetensors.numpy import save

    meta = {META_KEY: json.dumps({"protocol": PROTOCOL_VERSION, **fields})}
    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()}, metadata=meta)


def pack_step(step: Step) -> bytes:
    tensors = {"hidden": step.hidden.astype("<f4", copy=False),
               "positions": step.positions.astype("<i8", copy=False),
               "real": step.real.astype(bool, copy=False)}  # fmt: skip
    if step.allowed is not None:
        tensors["allowed"] = step.allowed.astype(bool, copy=False)
    if step.draws is not None:
        tensors["draws"] = step.draws.astype("<f8", copy=False)
    ops = []
    for i, op in enumerate(step.ops):
        ops.append([op.name, op.cache, op.other, op.a, op.b])
        if op.index is not None:
            tensors[f"index{i}"] = op.index.astype("<i8", copy=False)
    fields = {"kind": "step", **step.binding.fields(), "version": step.version,
              "cache": step.cache, "ops": ops,
              "distribution": list(step.distribution) if step.distribution else None}  # fmt: skip
    return _save(tensors, fields)


def pack_sampled(sampled: Sampled) -> bytes:
    tensors = {"tokens": sampled.tokens.astype("<i8", copy=False),
               "logprobs": sampled.logprobs.astype("<f4", copy=False),
               "below": sampled.below.astype("<f8", copy=False)}  # fmt: skip
    return _save(tensors, {"kind": "sampled", **sampled.binding.fields()})


def _header(raw: bytes) -> tuple[dict[str, tuple[str, list[int]]], dict]:
    """({tensor: (dtype, shape)}, the JSON fields): the safetensors header
    checked before anything reads the data (offsets cover it exactly)."""
    need(len(raw) <= MAX_STAGE_BYTES, f"stage message over {MAX_STAGE_BYTES} bytes")
    need(len(raw) >= 8, "not a stage message: no safetensors header")
    n = int.from_bytes(raw[:8], "little")
    need(n <= len(raw) - 8, f"header of {n} bytes, but {len(raw) - 8} bytes follow")
    head = loads(raw[8 : 8 + n], n, unique=True)
    meta = head.pop("__metadata__", None)
    need(isinstance(meta, dict) and set(meta) == {META_KEY}, f"metadata: {META_KEY!r} only")
    need(isinstance(meta[META_KEY], str), "metadata: a JSON string")
    fields = loads(meta[META_KEY].encode(), n, unique=True)
    need(len(head) <= MAX_OPS + 8, "too many tensors")
    out, spans = {}, []
    sizes = {v: k.itemsize for k, v in _SAFE.items()}
    for name, t in head.items():
        need(isinstance(t, dict) and set(t) == {"dtype", "shape", "data_offsets"}, name)
        need(t["dtype"] in sizes, f"{name}: dtype {t['dtype']!r}")
        shape, offsets = t["shape"], t["data_offsets"]
        need(isinstance(shape, list) and 1 <= len(shape) <= 4
             and all(is_int(d, 0, MAX_STAGE_BYTES) for d in shape), f"{name}: shape")  # fmt: skip
        need(isinstance(offsets, list) and len(offsets) == 2 and all(map(is_int, offsets)),
             f"{name}: data_offsets")  # fmt: skip
        need(offsets[1] - offsets[0] == int(np.prod(shape)) * sizes[t["dtype"]],
             f"{name}: data_offsets disagree with its shape")  # fmt: skip
        spans.append(offsets)
        out[name] = (t["dtype"], shape)
    end = 0
    for a, b in sorted(spans):
        need(a == end, "tensor data overlaps or leaves a gap")
        end = b
    need(end == len(raw) - 8 - n, "tensor data does not end the message")
    return out, fields


def _bound(fields: dict, expect: Binding, kind: str) -> None:
    need(fields.get("protocol") == PROTOCOL_VERSION, f"protocol: {PROTOCOL_VERSION}")
    need(fields.get("kind") == kind, f"kind: {kind}")
    theirs = {k: fields.get(k) for k in expect.fields()}
    need(theirs == expect.fields(), f"a message for {theirs}, expected {expect.fields()}")


def _arrays(raw: bytes, head: dict) -> dict[str, np.ndarray]:
    from safetensors import SafetensorError
    from safetensors.numpy import load

    try:
        arrays = load(raw)
    except (SafetensorError, ValueError) as e:
        raise SchemaError(f"not a safetensors message: {e}") from None
    need(set(arrays) == set(head), "tensors read back unlike the header")
    return arrays


def _shape(head: dict, name: str, dtype: str, shape: list[int | None]) -> list[int]:
    need(name in head, f"no tensor {name!r}")
    got_dtype, got = head[name]
    need(got_dtype == dtype, f"{name}: dtype {dtype}, not {got_dtype}")
    same = len(got) == len(shape) and all(
        w is None or w == g for w, g in zip(shape, got, strict=True)
    )
    need(same, f"{name}: shape {got}, expected {shape}")
    return got


def unpack_step(raw: bytes, expect: Binding, hidden_size: int) -> Step:
    """A checked `Step` from untrusted bytes, bound to `expect`."""
    head, d = _header(raw)
    _bound(d, expect, "step")
    need(set(d) == {"protocol", "kind", *expect.fields(), "version", "cache", "ops",
                    "distribution"}, "step fields")  # fmt: skip
    need(is_int(d["version"], 0, MAX_VERSION), "version: an integer >= 0")
    need(is_int(d["cache"], 0, MAX_CACHE_ID), "cache: an id")
    rows, width, _ = _shape(head, "hidden", "F32", [None, None, hidden_size])
    need(1 <= rows <= MAX_ROWS and 1 <= width <= MAX_COLUMNS, "hidden: rows and columns")
    _shape(head, "positions", "I64", [rows, width])
    _, columns = _shape(head, "real", "BOOL", [rows, None])
    need(width <= columns <= MAX_COLUMNS, "real: columns")
    if "allowed" in head:
        _shape(head, "allowed", "BOOL", [rows, 1, width, columns])
    dist = d["distribution"]
    if "draws" in head:
        _shape(head, "draws", "F64", [rows])
        need(isinstance(dist, list) and len(dist) == 3 and is_number(dist[0]) and dist[0] >= 0
             and is_int(dist[1], 0, 1 << 30) and is_number(dist[2]) and 0 < dist[2] <= 1,
             "distribution: [temperature, top_k, top_p]")  # fmt: skip
    else:
        need(dist is None, "distribution without draws")
    ops = _ops(d["ops"], head)
    known = {"hidden", "positions", "real", "allowed", "draws"}
    need(set(head) <= known | {f"index{i}" for i in range(len(ops))}, "unknown tensors")
    a = _arrays(raw, head)
    need(bool(np.isfinite(a["hidden"]).all()), "hidden: not finite")
    need(bool(((a["positions"] >= 0) & (a["positions"] < MAX_POSITION)).all()), "positions")
    draws = a.get("draws")
    need(draws is None or bool(((draws >= 0) & (draws < 1)).all()), "draws: in [0, 1)")
    for i, op in enumerate(ops):
        if OPS[op.name] is not None:
            op.index = a[f"index{i}"]
            if op.name == "stack":
                ids, pads = op.index[:, :1], op.index[:, 1:]
                need(op.index.shape[1] == 2 and op.index.shape[0] >= 1, f"op {i}: [others, 2]")
                need(bool(((ids >= 0) & (ids < MAX_CACHE_ID)).all()), f"op {i}: cache ids")
                need(bool(((pads >= 0) & (pads < MAX_COLUMNS)).all()), f"op {i}: pads")
                continue
            top = MAX_COLUMNS if op.name == "gather" else MAX_ROWS
            need(bool(((op.index >= 0) & (op.index < top)).all()), f"op {i}: index out of range")
    return Step(expect, d["cache"], ops, a["hidden"], a["positions"], a["real"],
                a.get("allowed"), draws, tuple(dist) if dist else None, d["version"])  # fmt: skip


def _ops(ops, head: dict) -> list[Op]:
    need(isinstance(ops, list) and len(ops) <= MAX_OPS, f"ops: at most {MAX_OPS}")
    out = []
    for i, o in enumerate(ops):
        need(isinstance(o, list) and len(o) == 5 and o[0] in OPS, f"op {i}: [name, ids, ints]")
        name, cache, other, a, b = o
        need(is_int(cache, 0, MAX_CACHE_ID) and is_int(other, -1, MAX_CACHE_ID),
             f"op {i}: cache ids")  # fmt: skip
        need(is_int(a, 0, MAX_COLUMNS) and is_int(b, 0, MAX_COLUMNS), f"op {i}: counts")
        dims = OPS[name]
        if dims is None:
            need(f"index{i}" not in head, f"op {i}: {name} takes no index")
        else:
            _, shape = head.get(f"index{i}", (None, []))
            need(f"index{i}" in head and head[f"index{i}"][0] == "I64" and len(shape) == dims,
                 f"op {i}: an int64 index of {dims} dimension(s)")  # fmt: skip
            need(shape[0] <= MAX_ROWS and (dims == 1 or shape[1] <= MAX_COLUMNS),
                 f"op {i}: index too large")  # fmt: skip
        out.append(Op(name, cache, other, a, b))
    return out


def unpack_sampled(raw: bytes, expect: Binding, vocab: int, rows: int) -> Sampled:
    """A checked `Sampled` from untrusted bytes: `rows` tokens (0: an
    acknowledgement), bound to `expect`."""
    head, d = _header(raw)
    _bound(d, expect, "sampled")
    need(set(d) == {"protocol", "kind", *expect.fields()}, "sampled fields")
    need(set(head) == {"tokens", "logprobs", "below"}, "tensors: tokens, logprobs, below")
    _shape(head, "tokens", "I64", [rows])
    _shape(head, "logprobs", "F32", [rows])
    _shape(head, "below", "F64", [rows])
    a = _arrays(raw, head)
    need(bool(((a["tokens"] >= 0) & (a["tokens"] < vocab)).all()), "token out of the vocabulary")
    need(bool((np.isfinite(a["logprobs"]) & (a["logprobs"] <= 0)).all()), "logprobs: ≤ 0")
    need(bool(((a["below"] >= 0) & (a["below"] <= 1)).all()), "below: in [0, 1]")
    return Sampled(expect, a["tokens"], a["logprobs"], a["below"])


def check_binding(run: str, group: str) -> None:
    """ValueError unless run and group are names a message can carry."""
    for what, v in (("run", run), ("group", group)):
        if not isinstance(v, str) or not 0 < len(v) <= MAX_FIELD:
            raise ValueError(f"{what}: 1 to {MAX_FIELD} characters")
