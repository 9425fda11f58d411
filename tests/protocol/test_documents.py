"""The typed documents beside the weights (heartbeats, quarantine, ledgers,
done.json), the metric rows, and the keys they live under."""

import ast
import json
import time
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import SchemaError, keys
from colonnade.protocol.documents import (
    Claim,
    ConsumedLedger,
    Done,
    Quarantine,
    QuarantineDecision,
    TrainerHeartbeat,
    open_claim,
    read_document,
    read_signed,
    seal_claim,
    sealed,
    write_signed,
)
from colonnade.protocol.metrics import (
    TRAINER_FIELDS,
    WORKER_FIELDS,
    TrainerRow,
    WorkerRow,
    declared,
    parse_rows,
)
from colonnade.protocol.presence import worker_heartbeats
from colonnade.protocol.schemas import dumps
from colonnade.protocol.signing import SignatureRejected, Signer
from colonnade.store import LocalStore, ObjectTooLarge
from heartbeats import worker_heartbeat

SRC = Path(__file__).resolve().parents[2] / "src" / "colonnade"
DIGEST = "ab" * 32
ROLLOUT = keys.rollout_key(3, "w1", 0)


def _signer(run_id="r1"):
    return Signer(Ed25519PrivateKey.generate(), run_id)


def _documents():
    return [
        worker_heartbeat("w1", version=None),
        worker_heartbeat("w-2.x", version=7, batches=3, bytes_synced=10**9, time=1e9),
        TrainerHeartbeat("0a1b2c3d", "host", 1e9, None),
        TrainerHeartbeat("0a1b2c3d", "host", 1e9, 12),
        Quarantine({}),
        Quarantine({"liar": QuarantineDecision("mismatch KL 2.1/token", 4, 1e9)}),
        ConsumedLedger([ROLLOUT], [keys.rollout_key(2, "w2", 5)], [DIGEST]),
        ConsumedLedger([], [], []),
        Done(20, 1e9),
        Claim("w1", 1e9),
    ]


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: type(d).__name__)
def test_documents_round_trip(doc):
    assert type(doc).from_json(doc.to_json()) == doc


def _wire(doc) -> dict:
    return json.loads(doc.to_json())


@pytest.mark.parametrize("doc", _documents(), ids=lambda d: type(d).__name__)
def test_documents_refuse_an_unknown_or_missing_field(doc):
    cls = type(doc)
    d = _wire(doc)
    if cls is Quarantine:  # a map of worker -> decision: the decision's fields
        d = {"w": {"reason": "r", "version": 1, "time": 1.0, "extra": 1}}
        with pytest.raises(SchemaError):
            cls.from_json(dumps(d))
        del d["w"]["extra"], d["w"]["time"]
        with pytest.raises(SchemaError):
            cls.from_json(dumps(d))
        return
    with pytest.raises(SchemaError, match="fields differ"):
        cls.from_json(dumps({**d, "extra": 1}))
    first = next(f.name for f in fields(cls) if f.name != "rejected")
    with pytest.raises(SchemaError, match="fields differ"):
        cls.from_json(dumps({k: v for k, v in d.items() if k != first}))


@pytest.mark.parametrize(
    ("cls", "good", "bad"),
    [
        (type(worker_heartbeat("w")), asdict(worker_heartbeat("w")),
         [("worker", "../etc"), ("worker", 5), ("version", -1), ("version", True),
          ("threads", 1.5), ("time", float("nan")), ("time", "now"), ("host", "h" * 300),
          ("bytes_synced", -1), ("engine", None)]),
        (TrainerHeartbeat, asdict(TrainerHeartbeat("i", "h", 1.0, 2)),
         [("instance", ""), ("version", "2"), ("time", -1.0)]),
        (Done, asdict(Done(3, 1.0)), [("version", None), ("version", 1.5), ("time", True)]),
        (Claim, asdict(Claim("w1", 1.0)), [("worker", "claims"), ("worker", "a/b"),
                                           ("time", -1.0), ("time", None)]),
        (ConsumedLedger, asdict(ConsumedLedger([ROLLOUT], [], [DIGEST])),
         [("keys", ["rollouts/x"]), ("keys", ROLLOUT), ("rejected", [ROLLOUT + "\n"]),
          ("digests", ["AB" * 32]), ("digests", [DIGEST[:-1]]), ("digests", None)]),
    ],
    ids=lambda x: getattr(x, "__name__", ""),
)  # fmt: skip
def test_documents_refuse_a_field_of_the_wrong_kind(cls, good, bad):
    assert cls.from_json(dumps(good))
    for name, value in bad:
        with pytest.raises(SchemaError):
            cls.from_json(json.dumps({**good, name: value}).encode())


def test_quarantine_refuses_a_bad_worker_or_decision():
    ok = {"reason": "r", "version": 1, "time": 1.0}
    for doc in ({"bad id!": ok}, {"w": {**ok, "version": -1}}, {"w": "reason"}, {"w": None}):
        with pytest.raises(SchemaError):
            Quarantine.from_json(dumps(doc))
    with pytest.raises(SchemaError):
        Quarantine.from_json(b"[]")


def test_documents_are_size_and_depth_bounded(tmp_path):
    huge = dumps({"worker": "w", "host": "x" * (2 << 20)})
    with pytest.raises(SchemaError):
        type(worker_heartbeat("w")).from_json(huge)
    with pytest.raises(SchemaError):
        Done.from_json(b'{"version": ' + b"[" * 10_000 + b"]" * 10_000 + b"}")
    store = LocalStore(tmp_path)
    store.put(keys.DONE, huge)
    with pytest.raises(ObjectTooLarge):
        read_document(store, keys.DONE, Done)
    assert read_document(store, keys.QUARANTINE, Quarantine) is None  # absent


def test_a_ledger_of_an_earlier_release_reads():
    old = json.dumps({"keys": [ROLLOUT], "digests": [DIGEST]}).encode()  # no "rejected"
    assert ConsumedLedger.from_json(old) == ConsumedLedger([ROLLOUT], [], [DIGEST])
    # but not with protocol 6's rollout keys, at the run's root
    p6 = json.dumps({"keys": ["rollouts/00000003/w1/000000.safetensors.zst"], "digests": []})
    with pytest.raises(SchemaError, match="rollout keys"):
        ConsumedLedger.from_json(p6.encode())


def test_the_trainers_documents_are_signed_for_their_key_and_run(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    trust = signer.trust
    done = Done(20, 1e9)
    write_signed(store, keys.DONE, done, signer)
    assert read_signed(store, keys.DONE, Done, trust) == done
    assert read_signed(store, keys.QUARANTINE, Quarantine, trust) is None  # absent

    def reason(data, key=keys.DONE, trust=trust):
        store.put(key, data)
        with pytest.raises(SignatureRejected) as e:
            read_signed(store, key, Done, trust)
        return e.value.reason

    assert reason(sealed(_signer(), keys.DONE, done)) == "bad_signature"  # another key
    # the trainer's own document, from another run or copied under another key
    assert reason(sealed(Signer(signer.private, "r2"), keys.DONE, done)) == "bad_signature"
    assert reason(sealed(signer, keys.HEARTBEAT, done)) == "bad_signature"
    env = json.loads(sealed(signer, keys.DONE, done))
    assert reason(dumps({**env, "signature": ""})) == "unsigned"
    env["doc"]["version"] = 21  # changed after signing
    assert reason(dumps(env)) == "bad_signature"
    store.put(keys.DONE, done.to_json())  # a plain document, as protocol 6 wrote it
    with pytest.raises(SchemaError):
        read_signed(store, keys.DONE, Done, trust)
    write_signed(store, keys.DONE, TrainerHeartbeat("i", "h", 1.0, 2), signer)
    with pytest.raises(SchemaError, match="fields differ"):  # signed, but not a Done
        read_signed(store, keys.DONE, Done, trust)
    store.put(keys.DONE, sealed(signer, keys.DONE, done) + b" " * (Done.MAX_BYTES + 4096))
    with pytest.raises(ObjectTooLarge):  # bounded before it is parsed
        read_signed(store, keys.DONE, Done, trust)


def test_claims_are_signed_by_the_worker_they_name():
    w1, w2 = Ed25519PrivateKey.generate(), Ed25519PrivateKey.generate()
    ring = {"w1": w1.public_key(), "w2": w2.public_key()}
    key = keys.claim_key(3, 0)
    claim = Claim("w1", 1e9)
    data = seal_claim(w1, "r1", key, claim)
    assert open_claim(data, key, "r1", ring) == claim
    assert open_claim(data, key, "r1", None) == claim  # a run that does not sign

    def reason(data, key=key, run="r1", ring=ring):
        with pytest.raises(SignatureRejected) as e:
            open_claim(data, key, run, ring)
        return e.value.reason

    assert reason(seal_claim(w2, "r1", key, claim)) == "bad_signature"  # w2 claiming as w1
    assert reason(data, keys.claim_key(3, 1)) == "bad_signature"  # copied to another slot
    assert reason(data, run="r2") == "bad_signature"  # of another run
    assert reason(seal_claim(None, "r1", key, claim)) == "unsigned"
    assert reason(seal_claim(w1, "r1", key, Claim("w9", 1.0))) == "unknown_key"
    # unsigned claims of an open run still name a worker
    assert open_claim(seal_claim(None, "r1", key, claim), key, "r1", None) == claim
    with pytest.raises(SchemaError):
        open_claim(claim.to_json(), key, "r1", None)  # protocol 6's plain claim


def test_worker_heartbeats_skip_what_does_not_read(tmp_path):
    inbox = LocalStore(tmp_path)
    inbox.put(keys.heartbeat_key("w1"), worker_heartbeat("w1", version=3).to_json())
    inbox.put(keys.heartbeat_key("w2"), worker_heartbeat("w1").to_json())  # names another worker
    inbox.put(keys.heartbeat_key("w3"), b'{"worker": "w3"}')
    inbox.put("w4/notes.txt", b"x")
    inbox.put("claims/heartbeat.json", worker_heartbeat("w5").to_json())  # no worker's folder
    hb = worker_heartbeats(inbox)
    assert list(hb) == ["w1"] and hb["w1"].version == 3


# -- keys -------------------------------------------------------------------------------


def test_every_key_parses_back():
    # the run's store
    assert keys.parse_consumed_key(keys.consumed_key(7, "0a1b2c3d")) == (7, "0a1b2c3d")
    # a ledger without an instance (protocol 6 and before) is no ledger of this protocol
    for bad in ("trainer/consumed/00000007.json", "trainer/consumed/7-a.json",
                "trainer/consumed/00000007-a-b.json", "trainer/consumed/00000007-a.json\n",
                None):  # fmt: skip
        assert keys.parse_consumed_key(bad) is None
    for bad in ("", "a-b", "x" * 65, "a/b"):
        with pytest.raises(ValueError):
            keys.consumed_key(1, bad)
    assert keys.parse_meta_key(keys.meta_key(12)) == 12
    assert keys.parse_meta_key(keys.full_key(12)) is None
    for key in (keys.full_key(5), keys.patch_key(5), keys.meta_key(5), "weights/00000005/junk/x"):
        assert keys.parse_weights_key(key) == 5
    for bad in (keys.LATEST, "weights/5/meta.json", "weights/00000005/", None):
        assert keys.parse_weights_key(bad) is None
    assert keys.parse_checkpoint_key(keys.checkpoint_state_key(4)) == (4, keys.CHECKPOINT_STATE)
    assert keys.trainer_segment_key(3) == "metrics/trainer-main/000003.jsonl"
    assert keys.parse_trainer_segment(keys.trainer_segment_key(3)) == 3
    for bad in ("metrics/trainer-main.jsonl", "metrics/worker-w1/000003.jsonl",
                "metrics/trainer-main/000003.jsonl\n"):  # fmt: skip
        assert keys.parse_trainer_segment(bad) is None
    assert keys.model_file("config.json") == keys.MODEL + "config.json"
    # the inbox: the shared claims, and each worker's folder
    assert keys.claim_key(7, 12) == "claims/00000007/000012.json"
    assert keys.parse_claim_key(keys.claim_key(7, 12)) == (7, 12)
    for bad in (-1, keys.MAX_SLOT + 1):
        with pytest.raises(ValueError):
            keys.claim_key(7, bad)
    with pytest.raises(ValueError):
        keys.rollout_key(7, "w1", keys.MAX_SEQ + 1)
    assert keys.heartbeat_key("w-1.a") == "w-1.a/heartbeat.json"
    assert keys.parse_heartbeat_key(keys.heartbeat_key("w-1.a")) == "w-1.a"
    for bad in ("a/b/heartbeat.json", "claims/heartbeat.json", "workers/w1.json"):
        assert keys.parse_heartbeat_key(bad) is None
    assert keys.worker_segment_key("w-1", 3) == "w-1/metrics/000003.jsonl"
    assert keys.parse_worker_segment(keys.worker_segment_key("w-1", 3)) == ("w-1", 3)
    for bad in ("metrics/worker-w-1/000003.jsonl", "claims/metrics/000003.jsonl"):
        assert keys.parse_worker_segment(bad) is None
    # whose each inbox key is: "" for a shared claim, None for no key of ours
    assert keys.inbox_owner(keys.claim_key(1, 0)) == ""
    assert keys.inbox_owner(keys.rollout_key(1, "w1", 0)) == "w1"
    assert keys.inbox_owner(keys.heartbeat_key("w2")) == "w2"
    assert keys.inbox_owner(keys.worker_segment_key("w3", 0)) == "w3"
    for junk in ("w1/notes.txt", "claims/00000001/0.json", "w1/rollouts/1/0.safetensors.zst",
                 "../w1/heartbeat.json", keys.RUN, ""):  # fmt: skip
        assert keys.inbox_owner(junk) is None, junk


# Run store keys, inbox folders, and protocol 6's keys (not to be spelled either).
KEY_PREFIXES = ("trainer/", "workers/", "metrics/", "rollouts/", "weights/", "report/", "model/",
                "inbox/", "claims/")  # fmt: skip


def test_no_key_is_spelled_outside_keys_py():
    """Every string literal in src/ that starts like a store key lives in
    protocol/keys.py; docstrings and comments may name keys."""
    found = []
    for path in SRC.rglob("*.py"):
        if path == SRC / "protocol" / "keys.py":
            continue
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith(KEY_PREFIXES)
                and id(node) not in docstrings
            ):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}: {node.value!r}")
    assert not found, found


# -- metric rows ------------------------------------------------------------------------


def _trainer_row(**kw) -> TrainerRow:
    base = dict(
        time=1e9, version=3, loss=0.1, reward_mean=0.5, pass_rate=0.25, groups=8, episodes=64,
        tokens=900, masked_fraction=0.01, mismatch_kl=0.002, grad_norm=1.5,
        gate_by_worker={"w1": {"tokens": 900, "kept": 890, "kl_sum": 1.8}},
        staleness={"0": 6, "1": 2}, wait_seconds=0.5, rejected=1, batches_trained=4,
        workers_alive=2, per_worker={"w1": {"groups": 8, "rejected_schema": 1}},
        counts={"batches_rejected": 1, "rejected_schema": 1, "batches_from_torch": 4},
        step_seconds=2.0, wait_fraction=0.25, publish_seconds=0.3, patch_bytes=1000,
        full_bytes=50_000, kind="patch",
    )  # fmt: skip
    return TrainerRow(**{**base, **kw})


def test_rows_round_trip_with_the_counters_flat_on_the_wire():
    row = _trainer_row()
    wire = row.to_dict()
    assert wire["rejected_schema"] == 1 and "counts" not in wire
    assert set(wire) == TRAINER_FIELDS | set(row.counts)
    assert TrainerRow.from_dict(json.loads(json.dumps(wire))) == row
    w = WorkerRow(time=1.0, version=2, version_skew=1, episodes=8, sync_seconds=0.5)
    assert set(w.to_dict()) == WORKER_FIELDS
    assert WorkerRow.from_dict(w.to_dict()) == w


def test_rows_read_strictly_by_name_and_type_leniently_by_absence():
    # A row of an earlier release may lack a figure: it reads as zero.
    assert TrainerRow.from_dict({"time": 1.0, "version": 2}) == TrainerRow(1.0, 2)
    assert WorkerRow.from_dict({"time": 1.0, "version": 2, "episodes": 8}).tokens == 0
    for bad in (
        {"version": 2},  # no time
        {"time": 1.0, "version": 2, "reward": 0.5},  # a name no row declares
        {"time": 1.0, "version": 2, "tokens": 1.5},
        {"time": 1.0, "version": True},
        {"time": float("inf"), "version": 2},
        {"time": 1.0, "version": 2, "staleness": {"1": "two"}},
        {"time": 1.0, "version": 2, "per_worker": {"w": [1]}},
        {"time": 1.0, "version": 2, "rejected_schema": 0.5},
        {"time": 1.0, "version": 2, "counts": {}},  # flat on the wire, never nested
        [],
    ):
        with pytest.raises(SchemaError):
            TrainerRow.from_dict(bad)
    with pytest.raises(SchemaError):  # the trainer's counters are not a worker's
        WorkerRow.from_dict({"time": 1.0, "version": 2, "batches_rejected": 1})
    raw = [{"time": 1.0, "version": 1}, {"time": "x"}, {"time": 2.0, "version": 2}]
    assert [r.version for r in parse_rows(TrainerRow, raw)] == [1, 2]


def test_declared_refuses_a_name_no_row_declares():
    assert declared(["version", "sync_bytes", "rejected_schema"]) == (
        "version", "sync_bytes", "rejected_schema",
    )  # fmt: skip
    with pytest.raises(ValueError, match="reward"):
        declared(["reward"])
    with pytest.raises(ValueError, match="sync_bytes"):
        declared(["sync_bytes"], (TrainerRow,))


# The modules that read metric rows: they take typed rows and read figures
# as attributes (a renamed field raises) or name them through `declared`.
READERS = ("report/build.py", "launch/live.py", "telemetry/exporter.py", "bench/e2e.py")


@pytest.mark.parametrize("module", READERS)
def test_row_readers_read_no_row_by_string_key(module):
    """No raw rows: neither `read_rows` (untyped JSON) nor a string-keyed read
    of a row field on anything that is not one of the module's own dicts."""
    tree = ast.parse((SRC / module).read_text())
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert "read_rows" not in names | attrs and "parse_rows" not in names | attrs
    keyed = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "get"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            keyed.add(node.args[0].value)
    # .get("name") on rows is gone; what is left reads other documents.
    # (config: the launch document's settings; version: an eval document's)
    own = {"started", "wall_s", "model", "preset", "status", "env", "groups", "config",
           "version", "batches_rejected", "batches_dropped_stale", "groups_rejected",
           "episodes_overflow"}  # fmt: skip
    assert keyed <= own, keyed - own
    # the counters read by name are declared ones
    declared(keyed & (own - {"started", "wall_s", "model", "preset", "status", "env", "config",
                             "version"}))  # fmt: skip


def test_row_readers_read_only_declared_fields(tmp_path, signed_run):
    """Every reader runs over typed rows: reading a field no row declares
    would raise AttributeError here."""
    from rich.console import Console

    from colonnade.bench.e2e import summarize
    from colonnade.launch.live import log_line, render, snapshot
    from colonnade.report import build_report
    from colonnade.telemetry import Telemetry
    from colonnade.telemetry.exporter import FIELDS

    store = LocalStore(tmp_path)
    signer = signed_run(store)
    inbox = store.sub(keys.INBOX)
    t = Telemetry.for_trainer(store, signer, 0)
    rows = [_trainer_row(version=v, time=1e9 + v) for v in (1, 2, 3)]
    for r in rows:
        t.write(r)
    w = Telemetry.for_worker(inbox, "w1", 0)
    w.write(WorkerRow(time=1e9, version=1, episodes=16, tokens=300, seconds=2.0, sync_bytes=9))
    inbox.put(keys.heartbeat_key("w1"), worker_heartbeat("w1", time=time.time()).to_json())
    write_signed(store, keys.consumed_key(1, "abc"), ConsumedLedger([ROLLOUT], [], [DIGEST]),
                 signer)  # fmt: skip
    decision = QuarantineDecision("mismatch", 2, 1.0)
    write_signed(store, keys.QUARANTINE, Quarantine({"liar": decision}), signer)
    store.put(keys.LAUNCH, b'{"started": 999999999.0, "status": "finished"}')
    report = build_report(store)
    assert report["rollouts_consumed"] == 12 and report["rejected_by_reason"] == {"schema": 1}
    assert report["quarantined"] == {"liar": asdict(decision)}
    assert report["workers"]["w1"]["episodes"] == 16 and report["workers"]["w1"]["engine"]
    assert report["series"]["version"] == [1, 2, 3]
    snap = snapshot(store, 10)
    assert snap.last == rows[-1] and snap.version == 3
    Console(record=True).print(render(snap, "training"))
    assert log_line(snap).startswith("v3/10 reward 0.500")
    assert summarize(rows, {"w1": [WorkerRow(1e9, 1, episodes=16)]}, 0.1)["versions"] == 3
    assert declared(FIELDS) and set(FIELDS) <= TRAINER_FIELDS | WORKER_FIELDS


def test_the_steps_figures_are_the_rows():
    from colonnade.train.step import ROW_FIELDS, StepFigures

    names = {f.name for f in fields(StepFigures)} - {"gate_by_version"}
    assert set(ROW_FIELDS) == names and names <= TRAINER_FIELDS
