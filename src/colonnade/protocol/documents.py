"""The small documents beside the weights: heartbeats, claims, the quarantine
file, the consumed ledgers and done.json (docs/protocol.md, "Documents"),
and how a signed document is written and read (`write_signed`,
`read_signed`: the trainer's documents travel in the envelope of
`protocol.signing`).

Each is a frozen dataclass, written with `to_json` and read with
`from_json` only: size-bounded, depth-bounded, every field present and of
its type, no field beyond them (like run.json and meta.json). They belong to
the protocol version run.json names; a change of fields is a new protocol.
Heartbeats and claims come from workers, so strangers: what fails its
checks is skipped by the readers, never trusted.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, TypeVar

from colonnade.store import NotFound, ObjectStore, StoreError, StoreUnavailable
from colonnade.untrusted import SchemaError, host_port, is_int, is_number, need

from .keys import check_worker_id, parse_rollout_key, parse_stage_link_key
from .schemas import MAX_JSON_BYTES, _same_fields, dumps, loads
from .signing import SignatureRejected, Signer, Trust, open_doc, read_envelope, seal_doc

MAX_TEXT = 256  # characters of a free-text field (host, platform, reason, ...)
MAX_LEDGER_BYTES = 64 << 20  # one version's ledger: keys and digests of its batches
_DIGEST = re.compile(r"[0-9a-f]{64}")


D = TypeVar("D")


def read_document(store: ObjectStore, key: str, cls: type[D]) -> D | None:
    """The document of type `cls` at `key`, None where there is none;
    SchemaError for one that does not read (the caller decides: skip or stop)."""
    try:
        data = store.get(key, max_bytes=cls.MAX_BYTES)
    except NotFound:
        return None
    return cls.from_json(data)


# What an envelope adds to its document: the run id, the key, a signature.
ENVELOPE_BYTES = 4096


def read_signed(store: ObjectStore, key: str, cls: type[D], trust: Trust) -> D | None:
    """The trainer's document of type `cls` at `key`, its signature checked
    against `trust`; None where there is none. SignatureRejected for one the
    trainer did not sign there, SchemaError for one that does not read."""
    limit = cls.MAX_BYTES + ENVELOPE_BYTES
    try:
        data = store.get(key, max_bytes=limit)
    except NotFound:
        return None
    return cls.from_json(dumps(trust.open(key, data, limit)))


def sealed(signer: Signer, key: str, doc: Any) -> bytes:
    """A document (anything with `to_json`) as the trainer's signed envelope for `key`."""
    return signer.seal(key, json.loads(doc.to_json()))


def write_signed(store: ObjectStore, key: str, doc: Any, signer: Signer) -> None:
    store.put(key, sealed(signer, key, doc))


def put_back(store: ObjectStore, key: str, mine: bytes) -> bool:
    """The object at `key` as `mine`, written again if anyone replaced or
    removed it; whether it had to be. An unavailable store is raised."""
    try:
        if store.get(key, max_bytes=len(mine)) == mine:
            return False
    except StoreUnavailable:
        raise
    except StoreError:  # missing, too large, not a readable object: ours goes back
        pass
    store.put(key, mine)
    return True


def _text(x: Any, what: str, empty: bool = True) -> None:
    ok = isinstance(x, str) and len(x) <= MAX_TEXT and (empty or x)
    need(bool(ok), f"{what}: a string of at most {MAX_TEXT} characters")


def _worker(x: Any, what: str) -> None:
    try:
        check_worker_id(x)
    except (TypeError, ValueError):
        raise SchemaError(f"{what}: not a worker id") from None


def _time(x: Any, what: str) -> None:
    need(is_number(x) and x >= 0, f"{what}: seconds since the epoch")


def _version(x: Any, what: str, none: bool = False) -> None:
    need(is_int(x) or (none and x is None), f"{what}: a version (integer >= 0)")


@dataclass(frozen=True)
class WorkerHeartbeat:
    """{worker}/heartbeat.json in the inbox: a worker says it lives, rewritten every ~20 s
    and once more when it exits. Read by the trainer (workers alive, from
    the object's time, not this), the live view and the report."""

    MAX_BYTES: ClassVar[int] = MAX_JSON_BYTES

    worker: str  # its id; must be the key's
    host: str  # host name
    platform: str  # OS and architecture, as Python's platform.platform() says
    device: str  # torch device it generates on: cpu, cuda:0, mps
    engine: str  # engine label: precision and kernel, e.g. "int8-w8", "mlx-int8"
    threads: int  # torch CPU threads
    version: int | None  # the version its engine runs; None before the first
    batches: int  # batches uploaded by this process
    bytes_synced: int  # weight bytes downloaded by this process
    time: float  # when written, seconds since the epoch (the writer's clock)
    started: float  # when the process joined, seconds since the epoch

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> WorkerHeartbeat:
        d = loads(data, cls.MAX_BYTES)
        _same_fields(cls, d, "worker heartbeat")
        _worker(d["worker"], "worker")
        for k in ("host", "platform", "device", "engine"):
            _text(d[k], k)
        for k in ("threads", "batches", "bytes_synced"):
            need(is_int(d[k]), f"{k}: integer >= 0")
        _version(d["version"], "version", none=True)
        _time(d["time"], "time")
        _time(d["started"], "started")
        return cls(**d)


@dataclass(frozen=True)
class Claim:
    """claims/{v}/{slot}.json in the inbox: a worker takes one slot of the trainer's demand
    for version v (put-if-absent: the first writer has it) and then makes
    that batch. Immutable. The trainer reads each claim once, to match it
    with the worker's batches; expiry is judged by the object's store time
    and the demand's lease, never by this `time`."""

    MAX_BYTES: ClassVar[int] = 4096

    worker: str  # who makes the batch; its uploads of version v fulfil its claims in order
    time: float  # when claimed, seconds since the epoch (the worker's clock; informational)

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> Claim:
        d = loads(data, cls.MAX_BYTES)
        _same_fields(cls, d, "claim")
        _worker(d["worker"], "worker")
        _time(d["time"], "time")
        return cls(**d)


def seal_claim(private, run_id: str, key: str, claim: Claim) -> bytes:
    """A worker's claim at `key`, signed with its key (None: an open run, unsigned)."""
    return seal_doc(private, run_id, key, json.loads(claim.to_json()))


def open_claim(data: bytes, key: str, run_id: str, keyring: dict | None) -> Claim:
    """The claim at `key`: of this run, and in a signed run (`keyring`: worker ->
    public key) signed by the worker it names. SchemaError otherwise."""
    return _open_workers(data, key, run_id, keyring, Claim, "a claim", Claim.MAX_BYTES)


def _open_workers(data, key, run_id, keyring, kind, what: str, max_bytes: int, check=None):
    """A worker's document of type `kind` at `key` (`what` names it in errors):
    of this run, passing `check(doc)`, and in a signed run signed by the
    worker it names."""
    env = read_envelope(data, key, max_bytes)
    if env["run"] != run_id:
        raise SignatureRejected("bad_signature", f"{key}: {what} of another run")
    doc = kind.from_json(dumps(env["doc"]))
    if check is not None:
        check(doc)
    if keyring is not None:
        public = keyring.get(doc.worker)
        if public is None:
            raise SignatureRejected("unknown_key", f"{key}: {doc.worker!r} is not registered")
        open_doc(env, run_id, public)
    return doc


@dataclass(frozen=True)
class StageAddress:
    """{worker}/stage-link.json in the inbox: where a pipeline stage on a
    direct link (`rollout/stagelink.py`) takes the messages of the stage
    before it, rewritten each time the stage starts. Signed in a signed run
    (the worker's registered key, as its claims): an address is where a
    stage's activations go, so only the stage itself may name it."""

    MAX_BYTES: ClassVar[int] = 4096

    worker: str  # the stage's id; must be the key's
    group: str  # its group's name (`stageworker.group_name`): a doc of another group is stale
    address: str  # HOST:PORT to dial ([V6]:PORT)
    time: float  # when written, seconds since the epoch (the writer's clock; informational)

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> StageAddress:
        d = loads(data, cls.MAX_BYTES)
        _same_fields(cls, d, "stage address")
        _worker(d["worker"], "worker")
        _text(d["group"], "group", empty=False)
        try:
            host_port(d["address"])
        except ValueError as e:
            raise SchemaError(f"address: {e}") from None
        _time(d["time"], "time")
        return cls(**d)


def seal_stage_address(private, run_id: str, key: str, doc: StageAddress) -> bytes:
    """A stage's address at `key`, signed with its key (None: an open run, unsigned)."""
    return seal_doc(private, run_id, key, json.loads(doc.to_json()))


def open_stage_address(data: bytes, key: str, run_id: str, keyring: dict | None) -> StageAddress:
    """The stage address at `key`: of this run and of the key's worker, and in
    a signed run (`keyring`: worker -> public key) signed by it. SchemaError
    otherwise."""

    def at_its_key(doc: StageAddress) -> None:
        if parse_stage_link_key(key) != doc.worker:
            raise SchemaError(f"{key}: the address of {doc.worker!r}")

    bound = StageAddress.MAX_BYTES + ENVELOPE_BYTES
    return _open_workers(data, key, run_id, keyring, StageAddress, "an address", bound, at_its_key)


@dataclass(frozen=True)
class TrainerHeartbeat:
    """trainer/heartbeat.json: the trainer lives; a second trainer started on
    the same prefix refuses to take over from a fresh one."""

    MAX_BYTES: ClassVar[int] = MAX_JSON_BYTES

    instance: str  # this trainer process's id (8 hex), also in its ledgers' keys
    host: str  # host name
    time: float  # when written, seconds since the epoch
    version: int | None  # the version it holds; None while starting

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> TrainerHeartbeat:
        d = loads(data, cls.MAX_BYTES)
        _same_fields(cls, d, "trainer heartbeat")
        _text(d["instance"], "instance", empty=False)
        _text(d["host"], "host")
        _time(d["time"], "time")
        _version(d["version"], "version", none=True)
        return cls(**d)


@dataclass(frozen=True)
class QuarantineDecision:
    """Why and when the trainer stopped taking one worker's batches."""

    reason: str  # the figure that stood out, against the others'
    version: int  # the version whose step decided it
    time: float  # when, seconds since the epoch

    @classmethod
    def from_dict(cls, d: Any) -> QuarantineDecision:
        need(isinstance(d, dict), "a quarantine decision is not an object")
        _same_fields(cls, d, "quarantine decision")
        _text(d["reason"], "reason")
        _version(d["version"], "version")
        _time(d["time"], "time")
        return cls(**d)


@dataclass(frozen=True)
class Quarantine:
    """trainer/quarantine.json: every worker quarantined so far (never
    lifted), rewritten whole on each new decision. On the wire the object
    maps worker id -> decision; latest.json counts the decisions, so workers
    reread this only when the count grows."""

    MAX_BYTES: ClassVar[int] = MAX_JSON_BYTES

    decisions: dict[str, QuarantineDecision] = field(default_factory=dict)  # worker -> decision

    def to_json(self) -> bytes:
        return dumps({w: asdict(d) for w, d in self.decisions.items()})

    @classmethod
    def from_json(cls, data: bytes) -> Quarantine:
        d = loads(data, cls.MAX_BYTES)
        for w in d:
            _worker(w, "quarantined worker")
        return cls({w: QuarantineDecision.from_dict(x) for w, x in d.items()})


@dataclass(frozen=True)
class ConsumedLedger:
    """trainer/consumed/{v}-{instance}.json: the batches a trainer took for
    version v, written before v is published and read on resume, so that no
    batch trains twice and no episodes replay."""

    MAX_BYTES: ClassVar[int] = MAX_LEDGER_BYTES

    keys: list[str]  # rollout keys trained on (at least one group accepted), sorted
    rejected: list[str]  # rollout keys taken and refused whole, sorted
    digests: list[str]  # content digests (sha256 hex) of the groups trained on, sorted

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> ConsumedLedger:
        d = loads(data, cls.MAX_BYTES)
        d = {"rejected": [], **d}  # absent from ledgers of earlier releases
        _same_fields(cls, d, "ledger")
        for k in ("keys", "rejected"):
            need(isinstance(d[k], list), f"{k}: a list of rollout keys")
            need(all(parse_rollout_key(x) for x in d[k]), f"{k}: a list of rollout keys")
        digests = d["digests"]
        need(isinstance(digests, list), "digests: a list of sha256 hex digests")
        need(all(isinstance(x, str) and _DIGEST.fullmatch(x) for x in digests),
             "digests: a list of sha256 hex digests")  # fmt: skip
        return cls(**d)


@dataclass(frozen=True)
class Done:
    """trainer/done.json: the run is over (latest.json says so too, and that
    is what workers poll)."""

    MAX_BYTES: ClassVar[int] = MAX_JSON_BYTES

    version: int  # the last version published
    time: float  # when, seconds since the epoch

    def to_json(self) -> bytes:
        return dumps(asdict(self))

    @classmethod
    def from_json(cls, data: bytes) -> Done:
        d = loads(data, cls.MAX_BYTES)
        _same_fields(cls, d, "done.json")
        _version(d["version"], "version")
        _time(d["time"], "time")
        return cls(**d)
