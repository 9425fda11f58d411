"""The fleet's figures read from the store: every worker's rows served on one
endpoint (the trainer's, or `colonnade exporter`'s), incrementally, bounded,
and whatever strangers put in the inbox."""

import os
import socket
import time
import urllib.request

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.cli.main import build_parser, main
from colonnade.protocol import keys
from colonnade.protocol.metrics import TrainerRow, WorkerRow
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import Signer
from colonnade.store import LocalStore, StoreUnavailable
from colonnade.store.counting import Counting
from colonnade.telemetry import Exporter, FleetReader, Telemetry, follow_run
from colonnade.telemetry import fleet as fleet_module
from colonnade.telemetry.rows import SEGMENT_ROWS


@pytest.fixture
def exporter():
    ex = Exporter(0, "main")
    yield ex
    ex.close()


def _value(ex: Exporter, name: str, worker: str, role: str = "worker"):
    return ex.registry.get_sample_value(name, {"role": role, "id": worker})


def _fleet(ex: Exporter, name: str, **labels):
    return ex.registry.get_sample_value(name, labels)


def _row(version=1, tokens=10, **kw) -> WorkerRow:
    return WorkerRow(time=time.time(), version=version, episodes=2, tokens=tokens, **kw)


def _age(store: LocalStore, key: str, seconds: float) -> None:
    """Set a stored object's store time `seconds` in the past."""
    t = time.time() - seconds
    os.utime(store.root / key, (t, t))


def test_workers_rows_are_served_under_their_ids(tmp_path, exporter):
    inbox = LocalStore(tmp_path)
    for w, tokens in (("w1", 10), ("w2", 7)):
        t = Telemetry.for_worker(inbox, w, flush_seconds=0)
        t.write(_row(version=3, tokens=tokens, version_skew=1, sync_bytes=100, sync_seconds=0.2))
        t.write(_row(version=4, tokens=tokens))
    FleetReader(exporter, inbox).poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 20
    assert _value(exporter, "colonnade_tokens_total", "w2") == 14
    assert _value(exporter, "colonnade_rollouts_total", "w1") == 4
    assert _value(exporter, "colonnade_version", "w2") == 4  # the last row's
    assert _value(exporter, "colonnade_sync_bytes_total", "w1") == 100
    assert _value(exporter, "colonnade_sync_seconds_count", "w1") == 2  # a row, an observation
    url = f"http://127.0.0.1:{exporter.port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    # The names and labels a worker's own endpoint serves (test_telemetry.py).
    assert 'colonnade_tokens_total{id="w1",role="worker"} 20.0' in text
    assert 'colonnade_fleet_workers{state="followed"} 2.0' in text


def test_a_poll_reads_only_what_changed_and_counters_only_grow(tmp_path, exporter):
    inbox = Counting(LocalStore(tmp_path))
    t = Telemetry.for_worker(inbox, "w1", flush_seconds=0)
    for _ in range(3):
        t.write(_row(tokens=10))
    key = keys.worker_segment_key("w1", 0)
    _age(inbox.inner, key, 60)
    reader = FleetReader(exporter, inbox)
    reader.poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 30
    inbox.counts.clear()
    reader.poll()  # nothing changed: one listing, no GET
    assert inbox.counts == {"list": 1}
    t.write(_row(tokens=5))
    reader.poll()
    assert inbox.counts["get"] == 1
    assert _value(exporter, "colonnade_tokens_total", "w1") == 35  # the new row only
    # The segment rewritten shorter (a stranger, a lost write): nothing goes back.
    inbox.put(key, inbox.get(key).splitlines(keepends=True)[0])
    reader.poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 35
    t.write(_row(tokens=1))  # rows past those fed are fed again
    reader.poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 36


def test_a_segment_written_again_within_its_store_time_is_read_again(tmp_path, exporter):
    inbox = LocalStore(tmp_path)
    t = Telemetry.for_worker(inbox, "w1", flush_seconds=0)
    t.write(_row(tokens=10))
    key = keys.worker_segment_key("w1", 0)
    stamp = time.time() - 1  # read within TIME_SLACK_SECONDS of its store time
    os.utime(inbox.root / key, (stamp, stamp))
    reader = FleetReader(exporter, inbox)
    reader.poll()
    t.write(_row(tokens=5))
    os.utime(inbox.root / key, (stamp, stamp))  # as coarse a store time as S3's second
    reader.poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 15


def test_segments_roll_over_and_a_worker_is_followed_from_its_newest(tmp_path, exporter):
    inbox = LocalStore(tmp_path)
    old = Telemetry.for_worker(inbox, "w0", flush_seconds=3600)
    for _ in range(SEGMENT_ROWS + 2):
        old.write(_row(tokens=1))
    old.flush()
    t = Telemetry.for_worker(inbox, "w1", flush_seconds=3600)
    for _ in range(SEGMENT_ROWS - 10):
        t.write(_row(tokens=1))
    t.flush()
    reader = FleetReader(exporter, inbox)
    reader.poll()
    # Its history before the reader started is the report's, not a rate's.
    assert _value(exporter, "colonnade_tokens_total", "w0") == 2
    assert _value(exporter, "colonnade_tokens_total", "w1") == SEGMENT_ROWS - 10
    for _ in range(13):  # fills segment 0 (written once more, full) and opens segment 1
        t.write(_row(tokens=1))
    t.flush()
    reader.poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == SEGMENT_ROWS + 3
    followed = reader.workers["w1"]
    assert followed.floor == 1 and set(followed.read) == {1}  # segment 0 is done


def test_strangers_objects_are_skipped_and_counted(tmp_path, exporter, monkeypatch):
    monkeypatch.setattr(fleet_module, "MAX_SEGMENT_BYTES", 4096)
    inbox = LocalStore(tmp_path)
    t = Telemetry.for_worker(inbox, "w1", flush_seconds=0)
    t.write(_row(tokens=10))
    inbox.put(keys.worker_segment_key("x1", 0), os.urandom(2000))  # not rows
    inbox.put(keys.worker_segment_key("x2", 0), b'{"time": 1}\n' * 1000)  # too large
    inbox.put(keys.worker_segment_key("x3", 0), b"[" * 3000)  # nested past the parser's depth
    bad_rows = b'{"time": 1, "version": "one"}\n{"time": 1, "version": 1, "bogus": 2}\n'
    inbox.put(keys.worker_segment_key("x4", 0), bad_rows + b'{"time": 1, "version": 2}\n')
    inbox.put("x5/metrics/notes.txt", b"not a key of ours")
    reader = FleetReader(exporter, inbox)
    assert reader.poll_safely()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 10
    assert _value(exporter, "colonnade_version", "x4") == 2  # its one good row
    assert _fleet(exporter, "colonnade_fleet_skipped_segments_total") == 3
    assert _fleet(exporter, "colonnade_fleet_skipped_rows_total") == 2
    reader.poll()  # unchanged: not read, not counted again
    assert _fleet(exporter, "colonnade_fleet_skipped_segments_total") == 3


def test_an_unavailable_store_ends_a_poll_not_the_reader(tmp_path, exporter):
    class Flaky(LocalStore):
        down = False

        def list_times(self, prefix=""):
            if self.down:
                raise StoreUnavailable("down")
            return super().list_times(prefix)

    inbox = Flaky(tmp_path)
    Telemetry.for_worker(inbox, "w1", flush_seconds=0).write(_row(tokens=10))
    reader = FleetReader(exporter, inbox)
    inbox.down = True
    assert not reader.poll_safely()
    assert _fleet(exporter, "colonnade_fleet_poll_errors_total") == 1
    inbox.down = False
    assert reader.poll_safely()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 10


def test_ids_past_the_cap_wait_and_silent_workers_are_forgotten(tmp_path, exporter):
    inbox = LocalStore(tmp_path)
    for w in ("w1", "w2", "w3"):
        Telemetry.for_worker(inbox, w, flush_seconds=0).write(_row(tokens=1))
    reader = FleetReader(exporter, inbox, max_workers=2, forget_seconds=600)
    reader.poll()
    assert set(reader.workers) == {"w1", "w2"}
    assert _fleet(exporter, "colonnade_fleet_workers", state="ignored") == 1
    assert _value(exporter, "colonnade_tokens_total", "w3") is None
    _age(inbox, keys.worker_segment_key("w1", 0), 3600)  # w1 went silent
    reader.poll()
    assert set(reader.workers) == {"w2", "w3"}
    assert _value(exporter, "colonnade_tokens_total", "w1") is None  # its series ended
    assert _value(exporter, "colonnade_tokens_total", "w3") == 1


def test_a_signed_run_serves_its_registered_workers_only(tmp_path, exporter):
    inbox = LocalStore(tmp_path)
    for w in ("w1", "w2"):
        Telemetry.for_worker(inbox, w, flush_seconds=0).write(_row(tokens=1))
    FleetReader(exporter, inbox, registered=lambda: {"w1"}).poll()
    assert _value(exporter, "colonnade_tokens_total", "w1") == 1
    assert _value(exporter, "colonnade_tokens_total", "w2") is None


def test_a_runs_store_alone_gives_the_trainer_and_its_registered_workers(tmp_path, signed_run):
    store = LocalStore(tmp_path)
    signer = signed_run(store, signed=True)
    inbox = store.sub(keys.INBOX)
    for w in ("w1", "w2"):
        Telemetry.for_worker(inbox, w, flush_seconds=0).write(_row(tokens=3))
    trainer = Telemetry.for_trainer(store, signer, 0)
    trainer.write(
        TrainerRow(time=time.time(), version=5, patch_bytes=1000, env_metrics={"searched": 0.5})
    )
    store.put(keys.KEYRING, signer.seal(keys.KEYRING, {"w1": "00" * 32}))
    ex = Exporter(0, "main", env_metrics=None)
    try:
        reader = follow_run(store, open_run(store), ex)
        reader.poll()
        assert _value(ex, "colonnade_version", "main", role="trainer") == 5
        assert _value(ex, "colonnade_published_bytes_total", "main", role="trainer") == 1000
        labels = {"role": "trainer", "id": "main", "metric": "searched"}
        assert ex.registry.get_sample_value("colonnade_env_metric", labels) == 0.5
        assert _value(ex, "colonnade_tokens_total", "w1") == 3
        assert _value(ex, "colonnade_tokens_total", "w2") is None  # not registered
        # A segment the trainer did not sign is skipped, and counted.
        forged = keys.trainer_segment_key(1)
        other = Signer(Ed25519PrivateKey.generate(), "r1")
        store.put(forged, other.seal_bytes(forged, b'{"time": 2.0, "version": 99}\n'))
        reader.poll()
        assert _value(ex, "colonnade_version", "main", role="trainer") == 5
        assert _fleet(ex, "colonnade_fleet_skipped_segments_total") == 1
    finally:
        ex.close()


def test_every_command_with_a_metrics_port_takes_a_metrics_host():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    with_port = {
        name
        for name, p in sub.choices.items()
        if any("--metrics-port" in a.option_strings for a in p._actions)
    }
    assert {"trainer", "worker", "run", "exporter"} <= with_port
    for name in with_port:
        flags = {f for a in sub.choices[name]._actions for f in a.option_strings}
        assert "--metrics-host" in flags, name


def test_the_exporter_command_refuses_bad_input(tmp_path, capsys, signed_run):
    assert main(["exporter", str(tmp_path / "none")]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["exporter", str(tmp_path)]) == 2  # no run.json
    assert "not a run" in capsys.readouterr().err
    assert main(["exporter", str(tmp_path), "--interval", "0"]) == 2
    assert "--interval" in capsys.readouterr().err
    signed_run(LocalStore(tmp_path))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["exporter", str(tmp_path), "--metrics-port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: cannot serve on 127.0.0.1:") and err.count("\n") == 1
    # Nothing written (opening the run's inbox folder makes the folder only).
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == ["run.json"]
