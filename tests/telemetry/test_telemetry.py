"""Metric rows in the store and the Prometheus endpoint fed by the same rows."""

import urllib.request

from colonnade.store import LocalStore
from colonnade.telemetry import Exporter, Telemetry, read_rows
from colonnade.telemetry.rows import SEGMENT_ROWS, parse_rows, segment_key


def test_rows_flush_and_survive_a_restart(tmp_path):
    store = LocalStore(tmp_path)
    t = Telemetry(store, "worker", "w1", flush_seconds=3600)
    t.row(version=0, episodes=8)
    assert not store.exists(segment_key("worker", "w1", 0))  # rate-limited
    t.flush()
    t2 = Telemetry(store, "worker", "w1", flush_seconds=0)  # a restarted process
    t2.row(version=1, episodes=8)
    rows = read_rows(store, "worker")["worker-w1"]
    assert [r["version"] for r in rows] == [0, 1] and all("time" in r for r in rows)
    Telemetry(store, "trainer", "main", 0).row(version=1)
    assert set(read_rows(store)) == {"worker-w1", "trainer-main"}
    assert set(read_rows(store, "trainer")) == {"trainer-main"}


def test_rows_go_to_append_only_segments(tmp_path):
    store = LocalStore(tmp_path)
    t = Telemetry(store, "trainer", "main", flush_seconds=0)
    for v in range(SEGMENT_ROWS + 3):
        t.row(version=v)
    assert store.list("metrics/") == [segment_key("trainer", "main", i) for i in (0, 1)]
    first = store.get(segment_key("trainer", "main", 0))
    assert len(t.rows) == 3  # one segment's rows in memory
    again = Telemetry(store, "trainer", "main", flush_seconds=0)  # a restart
    assert again.last["version"] == SEGMENT_ROWS + 2
    again.row(version=-1)
    assert store.get(segment_key("trainer", "main", 0)) == first  # never rewritten
    rows = read_rows(store, "trainer")["trainer-main"]
    assert [r["version"] for r in rows] == [*range(SEGMENT_ROWS + 3), -1]


def test_parse_rows_skips_broken_lines():
    assert parse_rows(b'{"a": 1}\nnot json\n[1, 2]\n{"b": 2}') == [{"a": 1}, {"b": 2}]


def test_exporter_serves_the_rows(tmp_path):
    ex = Exporter(0, "w9")
    try:
        t = Telemetry(LocalStore(tmp_path), "worker", "w9", 0, ex)
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
