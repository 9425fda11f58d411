"""`colonnade status`: states and flags on constructed rows, a constructed
store read whole, the command's edges, and a live run of real processes."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path

import pytest

from colonnade.cli.main import main
from colonnade.operate.status import (
    HEALTH,
    Facts,
    bounds,
    check,
    last_report,
    published_at,
    rate,
    read_status,
    render,
    status_of,
    tokens_per_s,
    worker_state,
)
from colonnade.protocol import RunSpec, keys
from colonnade.protocol.documents import Quarantine, QuarantineDecision, write_signed
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.metrics import TrainerRow, WorkerRow
from colonnade.store import LocalStore
from colonnade.telemetry import Telemetry
from heartbeats import worker_heartbeat
from procs import spawn, wait_until

NOW = 1_000_000.0
WORKER_FIELDS = {"id", "engine", "version", "lag", "state", "flags", "tokens_per_s",
                 "last_seen_s", "batches", "accepted_groups", "rejected", "rejected_batches",
                 "masked_fraction", "mismatch_kl", "quarantined", "quarantine"}  # fmt: skip
RUN_FIELDS = {"run_id", "env", "version", "done", "versions_per_minute", "since_version_s",
              "waste_fraction", "masked_fraction", "mismatch_kl", "workers_active", "max_lag",
              "workers", "flags", "healthy"}  # fmt: skip


def _spec(max_lag: int = 1) -> RunSpec:
    return RunSpec(run_id="r1", env="smoke", env_kwargs={}, model_files={}, vocab_size=2048,
                   precision="int8", group_size=4, groups_per_batch=2, max_lag=max_lag,
                   anchor_every=10, sampling={}, trainer_key="00" * 32)  # fmt: skip


def _figures(flags: list[dict]) -> set[str]:
    return {f["figure"] for f in flags}


# -- pure functions --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("age", "quarantined", "done", "state"),
    [
        (5.0, False, False, "active"),
        (60.0, False, False, "active"),  # the bound itself is still healthy
        (61.0, False, False, "stalled"),
        (3599.0, False, False, "stalled"),
        (3601.0, False, False, "gone"),  # retention deletes its heartbeat about now
        (None, False, False, "gone"),  # no heartbeat at all
        (61.0, False, True, "gone"),  # the run ended and so did it
        (5.0, False, True, "active"),
        (5.0, True, False, "quarantined"),
        (None, True, False, "quarantined"),  # quarantined wins over every other state
    ],
)
def test_worker_state(age, quarantined, done, state):
    assert worker_state(age, quarantined, done, stalled_after=60.0, gone_after=3600.0) == state


def test_check_flags_only_what_is_outside_its_bounds():
    assert check("lag", 1, 0, 1) is None
    assert check("lag", 2, 0, 1) == {"figure": "lag", "value": 2, "low": 0, "high": 1}
    assert check("mismatch_kl", -0.5, -0.04, 0.04)["value"] == -0.5
    assert check("workers_active", 0, 1, None)["figure"] == "workers_active"
    assert check("workers_active", 9, 1, None) is None
    assert check("waste_fraction", None, None, 0.2) is None  # no figure, no flag


def test_bounds_take_the_run_s_max_lag_and_the_stalled_after_given():
    assert bounds(_spec(max_lag=3))["lag"] == (0, 3)
    assert bounds(_spec())["last_seen_s"] == (0, HEALTH["last_seen_s"].high)
    assert bounds(_spec(), stalled_after=7.5)["last_seen_s"] == (0, 7.5)
    assert set(bounds(_spec())) == set(HEALTH)


def test_rates_over_recent_rows():
    rows = [TrainerRow(time=NOW + 6 * v, version=v) for v in range(1, 31)]
    assert rate(rows) == 10.0  # a version every 6 s
    slower = rows + [TrainerRow(time=NOW + 180 + 30 * i, version=31 + i) for i in range(10)]
    assert rate(slower) < 3.0  # the recent rows, not the run's mean
    assert rate(rows[:1]) is None and rate([]) is None
    batches = [WorkerRow(time=NOW, version=0, tokens=500, seconds=5.0)] * 30
    fast = [WorkerRow(time=NOW, version=1, tokens=1000, seconds=1.0)] * 10
    assert tokens_per_s(batches) == 100.0 and tokens_per_s(batches + fast) == 1000.0
    assert tokens_per_s([]) is None


def test_the_last_report_is_the_newest_word():
    rows = [WorkerRow(time=NOW - 30, version=4), WorkerRow(time=NOW - 10, version=7)]
    assert last_report(worker_heartbeat("w", version=5, time=NOW - 20), rows) == (NOW - 10, 7)
    assert last_report(worker_heartbeat("w", version=8, time=NOW - 2), rows) == (NOW - 2, 8)
    assert last_report(worker_heartbeat("w", version=None, time=NOW), []) is None
    trainer = [TrainerRow(time=NOW + v, version=v) for v in (1, 2, 3)]
    assert [published_at(trainer, NOW + t) for t in (0, 1, 2.5, 9)] == [0, 1, 2, 3]


def _report(**workers) -> dict:
    return {
        "versions_published": 20,
        "waste_fraction": 0.05,
        "gate": {"masked_fraction": 0.01, "mismatch_kl_mean": 0.002},
        "workers": {
            w: {
                "batches": 3,
                "groups_accepted": 6,
                "rejected": r,
                "engine": "int8-w8",
                "gate_masked_fraction": 0.01,
                "mismatch_kl": kl,
            }
            for w, (r, kl) in workers.items()
        },
        "quarantined": {},
    }


def _facts(report: dict, beats: dict[str, tuple[int, float]], done: bool = False) -> Facts:
    """`beats`: worker -> (version in its heartbeat, heartbeat age at NOW)."""
    hbs = {w: worker_heartbeat(w, version=v, time=NOW - age) for w, (v, age) in beats.items()}
    return Facts(
        spec=_spec(max_lag=2),
        report=report,
        # A version every second up to v20, published at NOW
        trainer=[TrainerRow(time=NOW - 20 + v, version=v) for v in range(1, 21)],
        workers={
            w: [WorkerRow(time=NOW - age, version=v, tokens=300, seconds=3.0)]
            for w, (v, age) in beats.items()
        },
        heartbeats=hbs,
        heard={w: NOW - age for w, (_, age) in beats.items()},
        done=done,
    )


def _by_id(status: dict) -> dict[str, dict]:
    return {w["id"]: w for w in status["workers"]}


def test_states_and_flags_of_a_fleet():
    report = _report(ok=({}, 0.001), rejecting=({"batches_rejected": 2, "rejected_replay": 2,
                                                 "groups_replayed": 4}, 0.001),
                     drifting=({}, 0.3), stalled=({}, 0.001), gone=({}, 0.9))  # fmt: skip
    report["quarantined"] = {"liar": {"reason": "mismatch KL", "version": 9, "time": NOW - 50}}
    beats = {"ok": (20, 3.0), "rejecting": (20, 3.0), "drifting": (20, 3.0),
             "stalled": (12, 400.0), "gone": (2, 7200.0), "liar": (20, 4.0)}  # fmt: skip
    facts = _facts(report, beats)
    status = status_of(facts, NOW)
    assert set(status) >= RUN_FIELDS and status["version"] == 20
    assert status["versions_per_minute"] == 60.0 and status["since_version_s"] == 0.0
    workers = _by_id(status)
    assert all(set(w) >= WORKER_FIELDS for w in workers.values())
    ok = workers["ok"]
    assert (ok["state"], ok["flags"], ok["lag"], ok["tokens_per_s"]) == ("active", [], 0, 100.0)
    assert workers["rejecting"]["rejected"] == {"replay": 2}
    assert _figures(workers["rejecting"]["flags"]) == {"rejected_batches"}
    assert _figures(workers["drifting"]["flags"]) == {"mismatch_kl"}
    stalled = workers["stalled"]
    # 8 versions behind: all published since it fell silent (silence, not lag)
    assert (stalled["state"], stalled["lag"]) == ("stalled", 8)
    assert _figures(stalled["flags"]) == {"last_seen_s"}
    assert (workers["gone"]["state"], workers["gone"]["flags"]) == ("gone", [])
    liar = workers["liar"]
    assert liar["state"] == "quarantined" and _figures(liar["flags"]) == {"quarantined"}
    assert liar["quarantine"]["reason"] == "mismatch KL"
    assert status["workers_active"] == 3 and status["flags"] == []
    text = render(status)
    assert "liar quarantined at v9: mismatch KL" in text and "stalled" in text
    assert "0.3!" in text  # the drifting worker's KL, marked


def test_lag_counts_from_the_worker_s_last_report():
    # Both last said v5 (heartbeats only): one 3 s ago, one 12 s ago.
    facts = _facts(_report(fresh=({}, 0.0), old=({}, 0.0)), {"fresh": (5, 3.0), "old": (5, 12.0)})
    workers = _by_id(status_of(dataclasses.replace(facts, workers={}), NOW))
    assert workers["fresh"]["lag"] == workers["old"]["lag"] == 15
    # 3 s ago v17 was the newest (v12 allowing for the clocks' slack): seven
    # behind, past max_lag 2. 12 s ago v8 was (v3 with the slack): it was not
    # behind then, and what it lags now is its report's age.
    assert _figures(workers["fresh"]["flags"]) == {"lag"}
    assert workers["old"]["flags"] == []


def test_run_flags():
    report = _report(w=({}, 0.0))
    report["waste_fraction"] = 0.4
    report["gate"] = {"masked_fraction": 0.2, "mismatch_kl_mean": -0.5}
    status = status_of(_facts(report, {"w": (20, 200.0)}), NOW)
    assert _figures(status["flags"]) == {"waste_fraction", "masked_fraction", "mismatch_kl",
                                         "workers_active"}  # fmt: skip
    assert "flag: waste_fraction 0.4 outside [-, 0.2]" in render(status)
    done = status_of(_facts(report, {"w": (20, 200.0)}, done=True), NOW)
    assert "workers_active" not in _figures(done["flags"])  # over: nobody needs to generate
    assert _by_id(done)["w"]["state"] == "gone"


# -- a constructed store, read whole ----------------------------------------------------------


def _constructed_run(tmp_path: Path, signed_run, now: float):
    """A signed run with v0..v3 published, the trainer's rows, three workers'
    rows and heartbeats (w2's written 200 s ago by its store time), and w3
    quarantined."""
    import torch

    from colonnade.protocol import Publisher

    store = LocalStore(tmp_path / "store")
    signer = signed_run(store, max_lag=1)
    pub = Publisher(store, signer, "bf16", anchor_every=10)
    for i in range(4):
        pub.publish({"w": torch.full((4,), float(i))})
    per_worker = {"w1": {"groups": 6}, "w2": {"groups": 2, "batches_rejected": 1,
                  "rejected_unclaimed": 1}, "w3": {"groups": 1}}  # fmt: skip
    trainer = Telemetry.for_trainer(store, signer, 0)
    for v in (1, 2, 3):
        gate = {"masked_fraction": 0.01, "mismatch_kl": 0.001}
        row = TrainerRow(time=now - 40 + 10 * v, version=v, groups=3, tokens=100,
                         per_worker=per_worker, **gate)  # fmt: skip
        trainer.write(row)
    inbox = store.sub(keys.INBOX)
    for w in ("w1", "w2", "w3"):
        t = Telemetry.for_worker(inbox, w, 0)
        t.write(WorkerRow(time=now - 5, version=3, episodes=8, tokens=400, seconds=2.0))
        t.flush()
        inbox.put(keys.heartbeat_key(w), worker_heartbeat(w, version=3, time=now).to_json())
    hb = tmp_path / "store" / keys.INBOX / keys.heartbeat_key("w2")
    os.utime(hb, (now - 200, now - 200))  # its heartbeats stopped
    decision = QuarantineDecision("mismatch KL 0.9 against 0.01", 2, now - 20)
    write_signed(store, keys.QUARANTINE, Quarantine({"w3": decision}), signer)
    return store, pub


def test_read_status_of_a_store(tmp_path, signed_run):
    now = time.time()
    store, pub = _constructed_run(tmp_path, signed_run, now)
    status = read_status(store, now=now)
    assert status["version"] == 3 and status["done"] is False and status["max_lag"] == 1
    assert status["versions_per_minute"] == 6.0
    workers = _by_id(status)
    assert [workers[w]["state"] for w in ("w1", "w2", "w3")] == ["active", "stalled", "quarantined"]
    assert workers["w1"]["flags"] == [] and workers["w1"]["tokens_per_s"] == 200.0
    assert workers["w2"]["rejected"] == {"unclaimed": 1}
    assert _figures(workers["w2"]["flags"]) == {"last_seen_s", "rejected_batches"}
    assert _figures(workers["w3"]["flags"]) == {"quarantined"}
    assert status["flags"] == []
    pub.point(done=True)
    after = _by_id(read_status(store, now=now))
    assert after["w2"]["state"] == "gone" and after["w1"]["state"] == "active"


# -- the command --------------------------------------------------------------------------------


def test_a_store_without_a_run_is_one_error_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["status", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no run.json under") and err.count("\n") == 1
    assert main(["status", str(tmp_path / "nowhere")]) == 2
    assert not (tmp_path / "nowhere").exists()  # nothing written
    assert "no such folder" in capsys.readouterr().err


def test_json_of_a_run_directory_and_a_key_it_was_not_signed_with(tmp_path, signed_run, capsys):
    _constructed_run(tmp_path, signed_run, time.time())  # a run directory: tmp_path/store
    assert main(["status", str(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) >= RUN_FIELDS and {w["id"] for w in doc["workers"]} == {"w1", "w2", "w3"}
    assert main(["status", str(tmp_path), "--trust", "SHA256:" + "A" * 43]) == 2
    assert "does not verify" in capsys.readouterr().err


def test_watch_repeats_until_ctrl_c(tmp_path, signed_run, capsys, monkeypatch):
    _constructed_run(tmp_path, signed_run, time.time())
    naps = []

    def sleep(seconds):
        naps.append(seconds)
        if len(naps) == 3:
            raise KeyboardInterrupt

    monkeypatch.setattr("colonnade.cli.status.time.sleep", sleep)
    assert main(["status", str(tmp_path / "store"), "--json", "--watch", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert naps == [2.0, 2.0, 2.0] and len(lines) == 3  # one document a refresh
    assert all(json.loads(line)["version"] == 3 for line in lines)
    assert main(["status", str(tmp_path / "store"), "--watch", "0"]) == 2


# -- a live run --------------------------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(420)
def test_status_of_a_live_run(tmp_path, capsys):
    """Trainer and three workers as processes (smoke preset): one keeps
    working, one is killed (its heartbeat then aged past the trainer's
    timeout), one is quarantined by the trainer's key; the status says so."""
    from colonnade.protocol.reader import open_run
    from colonnade.protocol.signing import Signer, load_private, new_keypair, trusted_fingerprint

    root = tmp_path / "run"
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    key, pub = new_keypair("trainer", tmp_path / "keys")
    trainer = ["trainer", "--store", str(root), "--preset", "smoke", "--key", str(key),
               "--max-versions", "1000", "--max-lag", "1"]  # fmt: skip
    procs = [spawn(trainer, tmp_path / "trainer.log", env)]
    try:
        store = LocalStore(root)
        wait_until(lambda: store.exists(keys.RUN), 120, "run.json", procs)
        view = open_run(store, trusted_fingerprint(str(pub)))
        ids = ("w1", "w2", "w3")
        procs += [spawn(["worker", "--store", str(root), "--id", w, "--trust", str(pub)],
                         tmp_path / f"{w}.log", env) for w in ids]  # fmt: skip

        def working() -> bool:
            listing = list_inbox(view.inbox)
            return set(listing.heartbeats) >= set(ids) and set(listing.segments) >= set(ids)

        wait_until(working, 180, "every worker's heartbeat and rows", procs)
        procs[2].send_signal(signal.SIGKILL)  # w2
        procs[2].wait()
        hb = root / keys.INBOX / keys.heartbeat_key("w2")
        old = time.time() - 600
        os.utime(hb, (old, old))  # as if it had been silent ten minutes
        signer = Signer(load_private(key)[1], view.spec.run_id)
        decision = QuarantineDecision("mismatch KL, planted by the test", 1, time.time())
        write_signed(store, keys.QUARANTINE, Quarantine({"w3": decision}), signer)
        assert main(["status", str(root), "--json", "--trust", str(pub)]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert main(["status", str(root)]) == 0
        text = capsys.readouterr().out
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert set(doc) >= RUN_FIELDS and doc["version"] >= 1 and doc["done"] is False
    assert doc["versions_per_minute"] is not None and doc["waste_fraction"] is not None
    workers = _by_id(doc)
    assert set(workers) == set(ids) and all(set(w) >= WORKER_FIELDS for w in workers.values())
    w1, w2, w3 = (workers[w] for w in ids)
    assert w1["state"] == "active" and w1["engine"].startswith("int8")
    assert w1["tokens_per_s"] > 0 and w1["version"] is not None
    assert not _figures(w1["flags"]) & {"last_seen_s", "quarantined"}
    assert w2["state"] == "stalled" and "last_seen_s" in _figures(w2["flags"])
    assert w3["state"] == "quarantined" and "quarantined" in _figures(w3["flags"])
    assert w3["quarantine"]["reason"] == "mismatch KL, planted by the test"
    assert "w3 quarantined at v1" in text and "stalled" in text
