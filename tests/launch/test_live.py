"""The live view: what a snapshot of the store shows."""

import json
import time

from rich.console import Console

from colonnade.envs import Metric, load_environment, metrics_of
from colonnade.launch.live import log_line, render, snapshot
from colonnade.protocol import keys
from colonnade.store import LocalStore
from colonnade.telemetry import Telemetry
from heartbeats import worker_heartbeat


def test_snapshot_and_render(tmp_path, signed_run):
    store = LocalStore(tmp_path)
    t = Telemetry.for_trainer(store, signed_run(store), 0)
    for v in (1, 2):
        t.row(version=v, reward_mean=0.5, pass_rate=0.25, masked_fraction=0.01,
              wait_fraction=0.3, step_seconds=2.0)  # fmt: skip
    hb = worker_heartbeat("w1", version=2, time=time.time(), bytes_synced=2_500_000)
    inbox = store.sub(keys.INBOX)
    inbox.put(keys.heartbeat_key("w1"), hb.to_json())
    inbox.put(keys.heartbeat_key("old"), worker_heartbeat("old", version=0, time=0.0).to_json())
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


def test_a_run_json_the_view_cannot_verify_shows_nothing(tmp_path, signed_run):
    store = LocalStore(tmp_path)
    signer = signed_run(store)
    Telemetry.for_trainer(store, signer, 0).row(version=3, reward_mean=0.5)
    assert snapshot(store, 10).version == 3
    env = json.loads(store.get(keys.RUN))
    env["doc"]["max_lag"] = 7  # changed after the trainer signed it
    store.put(keys.RUN, json.dumps(env).encode())
    snap = snapshot(store, 10)
    assert snap.version == 0 and snap.last is None


def _rows(store, env_metrics, signed_run):
    t = Telemetry.for_trainer(store, signed_run(store), 0)
    t.row(version=1, reward_mean=0.5, pass_rate=0.25, env_metrics=env_metrics)
    t.flush()


def test_the_view_shows_what_the_environment_declares(tmp_path, signed_run):
    store = LocalStore(tmp_path)
    _rows(store, {"hops": 0.75, "undeclared": 0.5}, signed_run)
    declared = (Metric("hops", "tool hops"),)
    snap = snapshot(store, 10, declared)
    console = Console(record=True, width=100)
    console.print(render(snap, "training"))
    text = console.export_text()
    assert "tool hops (train)" in text and "0.750" in text and "undeclared" not in text
    assert "pass 0.250 tool hops 0.750 masked" in log_line(snap)


def test_no_search_label_for_smoke(tmp_path, signed_run):
    store = LocalStore(tmp_path)
    _rows(store, {"format_ok": 1.0}, signed_run)
    snap = snapshot(store, 10, metrics_of(load_environment("smoke")))
    console = Console(record=True, width=100)
    console.print(render(snap, "training"))
    text = console.export_text() + log_line(snap)
    assert "format ok" in text and "search" not in text
