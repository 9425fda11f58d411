"""Retention: the store stays bounded over many versions, and what anyone can
still use is kept: a joiner reaches the newest version, a follower up to an
anchor window behind still patches forward, a resumed trainer finds its window."""

import os
import time

import pytest
import torch

from colonnade import pulse
from colonnade.protocol import Follower, Publisher, keys, latest_version, read_meta
from colonnade.store import AccessDenied, LocalStore
from colonnade.train.retention import Retention, departed, garbage

K, LAG = 4, 1


def test_garbage_is_what_no_step_or_joiner_can_use():
    listing = [
        "rollouts/00000007/w1/000000.json.zst",
        "rollouts/00000008/w1/000001.json.zst",
        "rollouts/00000009/w1/000002.json.zst",
        "trainer/consumed/00000008-abc.json",
        "trainer/consumed/00000009-abc.json",
        "weights/00000003/meta.json",
        "weights/00000004/full.safetensors",
        "weights/00000004/meta.json",
        "weights/00000009/patch.pulse",
        "weights/latest.json",
        "trainer/checkpoints/00000008/state.json",
        "run.json",
        "rollouts/0000000x/w1/000000.json.zst",
    ]
    # v9 published, max_lag 1: steps take versions 8.. ; the newest anchor is 8,
    # so versions from 4 (the anchor before) are kept for lagging followers.
    assert garbage(listing, 9, LAG, K) == [
        "rollouts/00000007/w1/000000.json.zst",
        "weights/00000003/meta.json",
    ]


def test_departed_are_the_heartbeats_silent_past_the_limit():
    ages = {"gone": 4100.0, "here": 100.0, "just": 3600.0}
    assert departed(ages, after=3600.0) == ["workers/gone.json", "workers/just.json"]
    assert departed(ages, after=3601.0) == ["workers/gone.json"]


def test_a_sweep_forgets_departed_workers_and_keeps_the_others(tmp_path):
    store = LocalStore(tmp_path)
    for w in ("old", "new"):
        store.put(keys.worker_key(w), b"{}")
    store.put("metrics/worker-old/000000.jsonl", b"{}\n")
    past = time.time() - 7200
    os.utime(tmp_path / keys.worker_key("old"), (past, past))
    assert Retention(store, LAG, K, forget_workers_seconds=3600).sweep(0) == 1
    assert store.list("workers/") == [keys.worker_key("new")]
    assert store.list("metrics/") == ["metrics/worker-old/000000.jsonl"]  # the record stays
    assert Retention(store, LAG, K, enabled=False).sweep(1) == 0


def _states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {"a": torch.randn(32, 16, generator=g), "b": torch.randn(16, generator=g)}
    out = [w]
    for _ in range(n - 1):
        w = {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in w.items()}
        out.append(w)
    return out


def test_a_long_run_keeps_a_bounded_store_and_everyone_can_still_sync(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store, "bf16", anchor_every=K)
    keep = Retention(store, LAG, K)
    lagging = Follower(store, K)
    counts = []
    for v, s in enumerate(_states(40)):
        pub.publish(s)
        store.put(keys.rollout_key(v, "w1", 0), b"batch")
        store.put(keys.consumed_key(v, "t"), b"{}")
        keep.sweep(v)
        counts.append(len(store.list("")))
        if v == 29:
            lagging.sync(29)
    # After warm-up the count repeats with every anchor window: it does not grow.
    assert all(counts[i] == counts[i + K] for i in range(12, len(counts) - K))
    assert max(counts) < 30
    assert store.list("rollouts/") == [keys.rollout_key(v, "w1", 0) for v in (38, 39)]
    # Joiner: the newest anchor and the patches after it.
    joiner = Follower(store, K)
    assert joiner.sync() and joiner.version == 39 == latest_version(store)
    assert pulse.state_hash(joiner.state) == read_meta(store, 39).state_hash
    # A follower left at v29 (one anchor window behind the newest anchor, v36):
    # its patches from v32 on are kept; older ones fall back to the anchor.
    assert lagging.sync(39) and lagging.state_hash == read_meta(store, 39).state_hash
    assert read_meta(store, 31) is None and read_meta(store, 32) is not None


def test_a_store_that_refuses_deletes_turns_retention_off(tmp_path, caplog):
    class NoDeletes(LocalStore):
        def delete(self, key):
            raise AccessDenied(f"{self.url}: delete {key}: access denied")

    store = NoDeletes(tmp_path)
    for v in range(5):
        store.put(keys.rollout_key(v, "w1", 0), b"batch")
    keep = Retention(store, LAG, K)
    assert keep.sweep(4) == 0 and not keep.enabled
    assert "retention is off" in caplog.text
    assert keep.sweep(5) == 0 and len(store.list("rollouts/")) == 5


@pytest.mark.s3
def test_s3_deletes_in_batches(seaweed, monkeypatch):
    from s3server import make_s3_store

    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    store = make_s3_store(seaweed)
    for i in range(5):
        store.put(f"rollouts/00000000/w1/{i:06d}.json.zst", b"x")
    store.delete_many([f"rollouts/00000000/w1/{i:06d}.json.zst" for i in range(4)] + ["nope"])
    assert store.list("rollouts/") == ["rollouts/00000000/w1/000004.json.zst"]
