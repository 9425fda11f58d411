"""Metric rows in the store and the Prometheus endpoint fed by the same rows."""

import json
import urllib.request

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import keys
from colonnade.protocol.signing import SignatureRejected, Signer
from colonnade.store import LocalStore
from colonnade.telemetry import (
    Exporter,
    Telemetry,
    read_trainer_rows,
    read_worker_rows,
    trainer_rows,
    worker_rows,
)
from colonnade.telemetry.rows import SEGMENT_ROWS, parse_rows


def _signer(run_id="r1"):
    return Signer(Ed25519PrivateKey.generate(), run_id)


def test_rows_flush_and_survive_a_restart(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    inbox = store.sub(keys.INBOX)
    t = Telemetry.for_worker(inbox, "w1", flush_seconds=3600)
    t.row(version=0, episodes=8)
    assert not inbox.exists(keys.worker_segment_key("w1", 0))  # rate-limited
    t.flush()
    assert inbox.exists(keys.worker_segment_key("w1", 0))
    t2 = Telemetry.for_worker(inbox, "w1", flush_seconds=0)  # a restarted process
    t2.row(version=1, episodes=8)
    rows = worker_rows(inbox)["w1"]
    assert [r["version"] for r in rows] == [0, 1] and all("time" in r for r in rows)
    assert [r.episodes for r in read_worker_rows(inbox)["w1"]] == [8, 8]
    Telemetry.for_trainer(store, signer, 0).row(version=1)
    # The trainer's rows in the run's store, each worker's in the inbox.
    assert [r["version"] for r in trainer_rows(store, signer.trust)] == [1]
    assert [r.version for r in read_trainer_rows(store, signer.trust)] == [1]
    assert set(worker_rows(inbox)) == {"w1"}
    assert set(worker_rows(store.sub("elsewhere/"))) == set()


def test_rows_go_to_append_only_segments(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    t = Telemetry.for_trainer(store, signer, flush_seconds=0)
    for v in range(SEGMENT_ROWS + 3):
        t.row(version=v)
    assert store.list("metrics/") == [keys.trainer_segment_key(i) for i in (0, 1)]
    first = store.get(keys.trainer_segment_key(0))
    assert len(t.rows) == 3  # one segment's rows in memory
    again = Telemetry.for_trainer(store, signer, flush_seconds=0)  # a restart
    assert again.last["version"] == SEGMENT_ROWS + 2
    again.row(version=-1)
    assert store.get(keys.trainer_segment_key(0)) == first  # never rewritten
    rows = trainer_rows(store, signer.trust)
    assert [r["version"] for r in rows] == [*range(SEGMENT_ROWS + 3), -1]


def test_the_trainers_segments_are_signed_and_others_skipped(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    trust = signer.trust
    t = Telemetry.for_trainer(store, signer, flush_seconds=0)
    t.row(version=1)
    key = keys.trainer_segment_key(0)
    assert json.loads(trust.open_bytes(key, store.get(key)))["version"] == 1
    with pytest.raises(SignatureRejected):  # not plain JSON lines anyone could write
        _signer().trust.open_bytes(key, store.get(key))
    # A segment the trainer did not sign is skipped by the readers...
    forged = keys.trainer_segment_key(1)
    store.put(forged, _signer().seal_bytes(forged, b'{"time": 2.0, "version": 99}\n'))
    store.put(keys.trainer_segment_key(2), b'{"time": 3.0, "version": 98}\n')
    assert [r["version"] for r in trainer_rows(store, trust)] == [1]
    # ...and a restarted trainer leaves it as it is and opens a new one.
    again = Telemetry.for_trainer(store, signer, flush_seconds=0)
    assert again.segment == 3 and again.last is None
    again.row(version=2)
    assert store.get(keys.trainer_segment_key(2)) == b'{"time": 3.0, "version": 98}\n'
    assert [r["version"] for r in trainer_rows(store, trust)] == [1, 2]


def test_parse_rows_skips_broken_lines():
    assert parse_rows(b'{"a": 1}\nnot json\n[1, 2]\n{"b": 2}') == [{"a": 1}, {"b": 2}]


def test_exporter_serves_the_rows(tmp_path):
    ex = Exporter(0, "w9")
    try:
        t = Telemetry.for_worker(LocalStore(tmp_path), "w9", 0, ex)
        t.row(version=4, version_skew=1, episodes=8, tokens=40, sync_seconds=0.3)
        t.row(version=5, episodes=8, staleness={"1": 2}, label="ignored")
        text = urllib.request.urlopen(f"http://127.0.0.1:{ex.port}/metrics", timeout=5).read()
        text = text.decode()
    finally:
        ex.close()
    assert 'colonnade_version{id="w9",role="worker"} 5.0' in text
    assert 'colonnade_rollouts_total{id="w9",role="worker"} 16.0' in text
    assert 'colonnade_tokens_total{id="w9",role="worker"} 40.0' in text
    assert 'colonnade_sync_seconds_count{id="w9",role="worker"} 1.0' in text
    assert 'colonnade_rollout_staleness_count{id="w9",role="worker"} 2.0' in text
