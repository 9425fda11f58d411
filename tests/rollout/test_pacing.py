"""Worker pacing: no batches of a version beyond a step's worth of its groups."""

import threading
import time
from types import SimpleNamespace

from colonnade.protocol import RunSpec, keys
from colonnade.protocol.schemas import dumps
from colonnade.rollout.worker import Worker, WorkerConfig
from colonnade.store import LocalStore


def _worker(tmp_path, pace_seconds=5.0, groups_per_step=4):
    store = LocalStore(tmp_path / "run")
    w = Worker(WorkerConfig(id="w1", pace_seconds=pace_seconds, poll_seconds=0.1), store)
    w.spec = RunSpec("r", "smoke", {}, [], 10, "int8", 4, 2, 1, 10, {},
                     groups_per_step=groups_per_step)  # fmt: skip
    w.follower = SimpleNamespace(version=3)
    return w, store


def _batch(store, v, worker, seq):
    store.put(keys.rollout_key(v, worker, seq), b"x")


def _publish(store, v):
    store.put(keys.meta_key(v), b"{}")
    store.put(keys.LATEST, dumps({"version": v}))


def test_quota_counts_every_workers_batches_of_the_version(tmp_path):
    w, store = _worker(tmp_path)
    _batch(store, 2, "w2", 0)  # an older version does not count
    _batch(store, 2, "w2", 1)
    _batch(store, 3, "w1", 0)
    assert not w.quota_full()  # 1 batch x 2 groups < 4
    _batch(store, 3, "w2", 0)
    assert w.quota_full()


def test_no_pacing_when_off_or_when_the_run_does_not_say_its_step(tmp_path):
    for w, store in (_worker(tmp_path / "a", pace_seconds=0), _worker(tmp_path / "b", 5.0, 0)):
        _batch(store, 3, "w1", 0)
        _batch(store, 3, "w2", 0)
        assert not w.quota_full()


def test_a_paced_worker_moves_on_when_a_newer_version_appears(tmp_path):
    w, store = _worker(tmp_path, pace_seconds=30.0)
    _publish(store, 3)
    threading.Timer(0.4, _publish, (store, 4)).start()
    t0 = time.monotonic()
    assert w.wait_for_newer()
    assert 0.3 < time.monotonic() - t0 < 5
    assert w.pending_time["paced_seconds"] > 0.3


def test_a_paced_worker_gives_up_waiting_after_pace_seconds(tmp_path):
    w, store = _worker(tmp_path, pace_seconds=0.5)
    _publish(store, 3)
    t0 = time.monotonic()
    assert not w.wait_for_newer()  # the quota's batches were refused: make one anyway
    assert time.monotonic() - t0 >= 0.5


def test_a_stop_or_the_runs_end_ends_the_wait(tmp_path):
    w, store = _worker(tmp_path, pace_seconds=30.0)
    _publish(store, 3)
    store.put(keys.DONE, b"{}")
    assert w.wait_for_newer()
    store.delete(keys.DONE)
    w.stop.requested = True
    assert w.wait_for_newer()
