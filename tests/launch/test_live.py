"""The live view: what a snapshot of the store shows."""

import time

from rich.console import Console

from colonnade.launch.live import log_line, render, snapshot
from colonnade.protocol import keys
from colonnade.store import LocalStore
from colonnade.telemetry import Telemetry
from heartbeats import worker_heartbeat


def test_snapshot_and_render(tmp_path):
    store = LocalStore(tmp_path)
    t = Telemetry(store, "trainer", "main", 0)
    for v in (1, 2):
        t.row(version=v, reward_mean=0.5, pass_rate=0.25, masked_fraction=0.01,
              wait_fraction=0.3, step_seconds=2.0)  # fmt: skip
    hb = worker_heartbeat("w1", version=2, time=time.time(), bytes_synced=2_500_000)
    store.put(keys.worker_key("w1"), hb.to_json())
    store.put(keys.worker_key("old"), worker_heartbeat("old", version=0, time=0.0).to_json())
    snap = snapshot(store, max_versions=10)
    assert snap.version == 2 and snap.eta_s == 16.0 and snap.synced_bytes == 2_500_000
    console = Console(record=True, width=100)
    console.print(render(snap, "training"))
    text = console.export_text()
    for want in ("2 / 10", "0.500", "0.250", "30%", "1: w1@v2", "2.50 MB", "16 s"):
        assert want in text, want
    assert "old" not in text  # a stale heartbeat is not alive
    assert log_line(snap).startswith("v2/10 reward 0.500 pass 0.250")


def test_empty_store_renders(tmp_path):
    snap = snapshot(LocalStore(tmp_path / "empty"), 5)
    assert snap.version == 0 and snap.eta_s is None
    Console(record=True).print(render(snap, "starting"))
