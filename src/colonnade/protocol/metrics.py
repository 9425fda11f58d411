"""Metric rows: the one declaration of every figure a process writes to
`metrics/{role}-{id}/{seg}.jsonl` (docs/protocol.md).

The trainer writes a `TrainerRow` per published version (`Trainer.step`,
with `train_step`'s figures); a worker writes a `WorkerRow` per uploaded
batch. The report, the live view, the Prometheus exporter and the e2e bench
read them through these types' attributes, and name fields only through
`declared`, which raises at import for a name no row declares: a renamed
field fails loudly instead of reading as missing.

On the wire a row is one flat JSON object (the field names below; the
collector's counters flattened beside them). Reading is strict about types
and names, lenient about absence: a figure a row lacks (a row of an earlier
release) reads as its default, zero. A row that fails (a field of another
type, a name no row declares) is skipped by the readers, as a line that is
not JSON is.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from colonnade.untrusted import SchemaError, is_int, is_number, need

# The collector's counters, cumulative over the run (whatever the trainer
# instance), flattened into the trainer's rows under these names:
# batches_rejected, batches_dropped_stale, groups_rejected, groups_replayed,
# batches_from_{engine} (batches trained on, per engine),
# rejected_{reason} (batches rejected, per reason) and
# groups_rejected_{reason} (groups rejected, where the replay names a reason);
# rewards_recomputed and rewards_trusted: episodes trained on whose reward
# the trainer computed, or took from a trusted worker (train/trust.py);
# episodes_overflow: episodes trained on that ended because a tool reply
# would have passed the episode's token budget (finish "overflow").
COUNT_NAMES = ("batches_rejected", "batches_dropped_stale", "groups_rejected", "groups_replayed",
               "rewards_recomputed", "rewards_trusted", "episodes_overflow")  # fmt: skip
REJECTED_PREFIX = "rejected_"  # rejected_{reason}: batches rejected for that reason
COUNT_PREFIXES = ("batches_from_", REJECTED_PREFIX, "groups_rejected_")


def is_count(name: str) -> bool:
    """Whether `name` is one of the collector's counters."""
    return name in COUNT_NAMES or (name.startswith(COUNT_PREFIXES) and name not in _PLAIN)


@dataclass(frozen=True)
class TrainerRow:
    """One published version, by the trainer (`metrics/trainer-main/`)."""

    time: float  # when the row was made, seconds since the epoch
    version: int  # the version this step made (and published)
    # train_step's figures, over the step's model tokens
    loss: float = 0.0  # DPPO loss per kept token
    reward_mean: float = 0.0  # mean recomputed reward of the step's episodes
    pass_rate: float = 0.0  # share of the step's episodes solved (the env's success rule)
    groups: int = 0  # groups trained on (skipped ones included)
    groups_skipped: int = 0  # groups of equal rewards: no advantage, no samples
    episodes: int = 0  # episodes in those groups
    tokens: int = 0  # model tokens of the samples trained on
    micro_batches: int = 0  # micro-batches the samples were packed into
    masked_fraction: float = 0.0  # share of tokens the DPPO gate masked
    mean_abs_diff: float = 0.0  # mean |π − μ| per token (probabilities)
    mismatch_kl: float = 0.0  # mean (log μ − log π) per token: k1 estimate of KL(μ‖π)
    grad_norm: float = 0.0  # global gradient norm before clipping
    # worker -> {"tokens": int, "kept": int, "kl_sum": float}: the gate per worker
    gate_by_worker: dict[str, dict[str, float]] = field(default_factory=dict)
    # each metric the environment declares (`envs.metrics_of`) -> its mean over the step's episodes
    env_metrics: dict[str, float] = field(default_factory=dict)
    # the collection
    staleness: dict[str, int] = field(default_factory=dict)  # str(version lag) -> groups
    wait_seconds: float = 0.0  # waiting for enough groups
    rejected: int = 0  # batches and groups rejected during this step's collection
    batches_trained: int = 0  # batches with a group trained on
    workers_alive: int = 0  # workers with a heartbeat younger than heartbeat_timeout
    # worker -> {counter: n}: "groups" accepted, and the counters below, per worker
    per_worker: dict[str, dict[str, int]] = field(default_factory=dict)
    # COUNT_NAMES and COUNT_PREFIXES' names -> n, cumulative; flattened on the wire
    counts: dict[str, int] = field(default_factory=dict)
    # the step's time
    step_seconds: float = 0.0  # from the start of collection to the background hand-off
    wait_fraction: float = 0.0  # wait_seconds / step_seconds
    publish_blocked_seconds: float = 0.0  # waiting for the previous background publication
    spot_rows: int = 0  # rows the spot checks recomputed during this step's collection
    spot_seconds: float = 0.0  # the time they took (part of step_seconds)
    peak_mem_mb: float = 0.0  # peak device (or resident) memory
    # the publication (background)
    deleted: int = 0  # objects retention deleted after publishing
    publish_seconds: float = 0.0  # time to publish the version
    patch_bytes: int = 0  # weights/{v}/patch.pulse
    anchor_bytes: int = 0  # weights/{v}/full.safetensors; 0 unless an anchor
    full_bytes: int = 0  # a full state at the run's precision
    kind: str = ""  # "full" for an anchor version, else "patch"

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: Any) -> TrainerRow:
        return cls(**_from_dict(cls, d, counts=True))


def gate_figures(stats: dict[str, float]) -> tuple[float, float]:
    """(|mismatch KL| per token, masked fraction) of one worker's gate stats
    (a `gate_by_worker` value, or a sum of them)."""
    n = max(1, stats["tokens"])
    return abs(stats["kl_sum"]) / n, 1.0 - stats["kept"] / n


def add_gate_stats(total: dict[str, dict], step: dict[str, dict]) -> None:
    """Add one row's `gate_by_worker` into the running totals per worker."""
    for w, s in step.items():
        t = total.setdefault(w, {"tokens": 0, "kept": 0, "kl_sum": 0.0})
        for k in t:
            t[k] += s[k]


@dataclass(frozen=True)
class WorkerRow:
    """One uploaded batch, by a worker (`{worker}/metrics/` in the inbox)."""

    time: float  # when the row was made, seconds since the epoch
    version: int  # the version that made the batch
    version_skew: int = 0  # the newest version when the batch landed, minus `version`
    episodes: int = 0  # episodes in the batch
    tokens: int = 0  # model tokens in the batch
    seconds: float = 0.0  # to generate and upload the batch
    reward_mean: float = 0.0  # the worker's own mean reward (never trusted)
    # since the previous row:
    sync_bytes: int = 0  # weight bytes downloaded
    store_errors: int = 0  # store calls that failed
    store_retries: int = 0  # store calls retried
    sync_seconds: float = 0.0  # apply_seconds + load_seconds
    apply_seconds: float = 0.0  # download, patch, hash check (beside generation)
    load_seconds: float = 0.0  # changed tensors into the engine (generation stalls)
    paced_seconds: float = 0.0  # idle: the demand had no slot for the version it runs
    unverified: int = 0  # documents read that the trainer did not sign (ignored)
    tool_failures: int = 0  # episodes ended because their tool service gave no reply
    overflows: int = 0  # episodes ended because a tool reply would pass the token budget

    def to_dict(self) -> dict[str, Any]:
        return _to_dict(self)

    @classmethod
    def from_dict(cls, d: Any) -> WorkerRow:
        return cls(**_from_dict(cls, d, counts=False))


def _names(cls) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls) if f.name != "counts")


TRAINER_FIELDS = _names(TrainerRow)  # wire names of the trainer's figures (counters aside)
WORKER_FIELDS = _names(WorkerRow)
_PLAIN = TRAINER_FIELDS | WORKER_FIELDS  # e.g. `rejected`: a figure, not a counter


def declared(
    names: Iterable[str], rows: tuple[type, ...] = (TrainerRow, WorkerRow)
) -> tuple[str, ...]:
    """`names`, each checked to be a field of one of `rows` (or, for the
    trainer's, a counter): a ValueError naming the others. Modules that name
    row fields call it at import."""
    names = tuple(names)
    known = frozenset().union(*(_names(r) for r in rows))
    counts = TrainerRow in rows
    bad = [n for n in names if n not in known and not (counts and is_count(n))]
    if bad:
        raise ValueError(f"not a field of {', '.join(r.__name__ for r in rows)}: {bad}")
    return names


def _to_dict(row) -> dict[str, Any]:
    out = {f.name: getattr(row, f.name) for f in fields(row) if f.name != "counts"}
    out.update(getattr(row, "counts", {}))
    return out


def _is_int(x: Any) -> bool:
    return is_int(x, -math.inf, math.inf)  # a row's integers are not bounded


def _table(x: Any, value) -> bool:
    return isinstance(x, dict) and all(isinstance(k, str) and value(v) for k, v in x.items())


# A field's annotation -> its check.
_CHECKS = {
    "int": _is_int,
    "float": is_number,
    "str": lambda x: isinstance(x, str) and len(x) <= 64,
    "dict[str, int]": lambda x: _table(x, _is_int),
    "dict[str, float]": lambda x: _table(x, is_number),
    "dict[str, dict[str, int]]": lambda x: _table(x, lambda v: _table(v, _is_int)),
    "dict[str, dict[str, float]]": lambda x: _table(x, lambda v: _table(v, is_number)),
}


def _from_dict(cls, d: Any, counts: bool) -> dict[str, Any]:
    need(isinstance(d, dict), "a metric row is not an object")
    out: dict[str, Any] = {}
    found: dict[str, int] = {}
    for name, value in d.items():
        f = cls.__dataclass_fields__.get(name)
        if f is not None and name != "counts":
            need(_CHECKS[f.type](value), f"{name}: not a {f.type}")
            out[name] = value
        elif counts and isinstance(name, str) and is_count(name):
            need(_is_int(value), f"{name}: a count")
            found[name] = value
        else:
            raise SchemaError(f"{name!r}: not a field of {cls.__name__}")
    for f in fields(cls):
        need(f.name in out or f.default is not MISSING or f.default_factory is not MISSING
             or f.name == "counts", f"{f.name}: missing")  # fmt: skip
    if counts:
        out["counts"] = found
    return out


def parse_rows(cls, rows: Iterable[dict]) -> list:
    """The rows of `cls` among raw JSON objects; rows that fail are skipped."""
    out = []
    for r in rows:
        try:
            out.append(cls.from_dict(r))
        except SchemaError:
            continue
    return out
