"""The typed documents beside the weights (heartbeats, quarantine, ledgers,
done.json), the metric rows, and the keys they live under."""

import ast
import json
import time
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from colonnade.protocol import SchemaError, keys
from colonnade.protocol.documents import (
    ConsumedLedger,
    Done,
    Quarantine,
    QuarantineDecision,
    TrainerHeartbeat,
    read_document,
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
from colonnade.store import LocalStore, ObjectTooLarge
from heartbeats import worker_heartbeat

SRC = Path(__file__).resolve().parents[2] / "src" / "colonnade"
DIGEST = "ab" * 32
ROLLOUT = keys.rollout_key(3, "w1", 0)


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


def test_worker_heartbeats_skip_what_does_not_read(tmp_path):
    store = LocalStore(tmp_path)
    store.put(keys.worker_key("w1"), worker_heartbeat("w1", version=3).to_json())
    store.put(keys.worker_key("w2"), worker_heartbeat("w1").to_json())  # names another worker
    store.put(keys.worker_key("w3"), b'{"worker": "w3"}')
    store.put(keys.WORKERS + "notes.txt", b"x")
    hb = worker_heartbeats(store)
    assert list(hb) == ["w1"] and hb["w1"].version == 3


# -- keys -------------------------------------------------------------------------------


def test_every_key_parses_back():
    assert keys.parse_consumed_key(keys.consumed_key(7, "0a1b2c3d")) == (7, "0a1b2c3d")
    assert keys.parse_consumed_key("trainer/consumed/00000007.json") == (7, "")  # earlier
    for bad in ("trainer/consumed/7-a.json", "trainer/consumed/00000007-a-b.json",
                "trainer/consumed/00000007-a.json\n", None):  # fmt: skip
        assert keys.parse_consumed_key(bad) is None
    for bad in ("", "a-b", "x" * 65, "a/b"):
        with pytest.raises(ValueError):
            keys.consumed_key(1, bad)
    assert keys.parse_worker_key(keys.worker_key("w-1.a")) == "w-1.a"
    assert keys.parse_worker_key("workers/a/b.json") is None
    assert keys.parse_meta_key(keys.meta_key(12)) == 12
    assert keys.parse_meta_key(keys.full_key(12)) is None
    assert keys.parse_version_dir(keys.full_key(5)) == ("weights", 5)
    assert keys.parse_version_dir(keys.rollouts_dir(5) + "junk/x") == ("rollouts", 5)
    assert keys.parse_version_dir(keys.LATEST) is None
    assert keys.parse_checkpoint_key(keys.checkpoint_state_key(4)) == (4, keys.CHECKPOINT_STATE)
    assert keys.parse_metrics_key(keys.metrics_key("worker", "w-1", 3)) == ("worker", "w-1", 3)
    assert keys.parse_metrics_key("metrics/trainer-main.jsonl") == ("trainer", "main", -1)
    assert keys.metrics_dir("trainer", "main") == "metrics/trainer-main/"
    with pytest.raises(ValueError):
        keys.metrics_dir("Trainer", "main")


KEY_PREFIXES = ("trainer/", "workers/", "metrics/", "rollouts/", "weights/", "report/", "model/")


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
           "version", "batches_rejected", "batches_dropped_stale", "groups_rejected"}  # fmt: skip
    assert keyed <= own, keyed - own
    # the counters read by name are declared ones
    declared(keyed & (own - {"started", "wall_s", "model", "preset", "status", "env", "config",
                             "version"}))  # fmt: skip


def test_row_readers_read_only_declared_fields(tmp_path):
    """Every reader runs over typed rows: reading a field no row declares
    would raise AttributeError here."""
    from rich.console import Console

    from colonnade.bench.e2e import summarize
    from colonnade.launch.live import log_line, render, snapshot
    from colonnade.report import build_report
    from colonnade.telemetry import Telemetry
    from colonnade.telemetry.exporter import FIELDS

    store = LocalStore(tmp_path)
    t = Telemetry(store, "trainer", "main", 0)
    rows = [_trainer_row(version=v, time=1e9 + v) for v in (1, 2, 3)]
    for r in rows:
        t.write(r)
    w = Telemetry(store, "worker", "w1", 0)
    w.write(WorkerRow(time=1e9, version=1, episodes=16, tokens=300, seconds=2.0, sync_bytes=9))
    store.put(keys.worker_key("w1"), worker_heartbeat("w1", time=time.time()).to_json())
    store.put(keys.consumed_key(1, "abc"), ConsumedLedger([ROLLOUT], [], [DIGEST]).to_json())
    decision = QuarantineDecision("mismatch", 2, 1.0)
    store.put(keys.QUARANTINE, Quarantine({"liar": decision}).to_json())
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
