"""Retention: the store stays bounded over many versions, and what anyone can
still use is kept: a joiner reaches the newest version, a follower up to an
anchor window behind still patches forward, a resumed trainer finds its window."""

import os
import time

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade import pulse
from colonnade.protocol import Follower, Publisher, keys, latest_version, read_meta
from colonnade.protocol.inbox import scan
from colonnade.protocol.signing import Signer
from colonnade.store import AccessDenied, LocalStore
from colonnade.train.retention import Retention, departed, garbage, inbox_garbage

K, LAG = 4, 1


def test_garbage_is_what_no_step_or_joiner_can_use():
    listing = [
        "trainer/consumed/00000007-abc.json",
        "trainer/consumed/00000008-abc.json",
        "trainer/consumed/00000009-abc.json",
        "weights/00000003/meta.json",
        "weights/00000004/full.safetensors",
        "weights/00000004/meta.json",
        "weights/00000009/patch.pulse",
        "weights/00000010/meta.json",
        "weights/latest.json",
        "trainer/checkpoints/00000008/state.json",
        "run.json",
    ]
    # v9 published, max_lag 1: steps take versions 8.. ; the newest anchor is 8,
    # so versions from 4 (the anchor before) are kept for lagging followers.
    # A version beyond v9 is no version the trainer published.
    assert garbage(listing, 9, LAG, K) == [
        "trainer/consumed/00000007-abc.json",
        "weights/00000003/meta.json",
        "weights/00000010/meta.json",
    ]


def test_inbox_garbage_is_old_rollouts_and_claims_and_what_is_not_ours():
    at = 1.0
    inbox = {
        keys.rollout_key(7, "w1", 0): at,
        keys.rollout_key(8, "w1", 1): at,
        keys.rollout_key(9, "w1", 2): at,
        keys.rollout_key(11, "w1", 3): at,  # a version not yet published
        keys.claim_key(7, 0): at,
        keys.claim_key(8, 0): at,
        keys.claim_key(10, 0): at,  # the next version's slots may open: kept
        keys.claim_key(12, 0): at,
        keys.heartbeat_key("w1"): at,
        keys.worker_segment_key("w1", 0): at,
        "rollouts/0000000x/w1/000000.json.zst": at,  # no key of ours
        keys.heartbeat_key("stranger"): at,
    }
    expected = [
        keys.claim_key(7, 0),
        keys.rollout_key(7, "w1", 0),
        "rollouts/0000000x/w1/000000.json.zst",
        keys.heartbeat_key("stranger"),  # a signed run registers w1 only
        keys.claim_key(12, 0),
        keys.rollout_key(11, "w1", 3),
    ]
    assert inbox_garbage(scan(inbox, {"w1"}, 9), 9, LAG) == expected
    # An open run takes any well-formed id.
    assert keys.heartbeat_key("stranger") not in inbox_garbage(scan(inbox, None, 9), 9, LAG)


def test_departed_are_the_heartbeats_silent_past_the_limit():
    ages = {"gone": 4100.0, "here": 100.0, "just": 3600.0}
    gone, just = keys.heartbeat_key("gone"), keys.heartbeat_key("just")
    assert departed(ages, after=3600.0) == [gone, just]
    assert departed(ages, after=3601.0) == [gone]


def test_a_sweep_forgets_departed_workers_and_keeps_the_others(tmp_path):
    store = LocalStore(tmp_path)
    inbox = store.sub(keys.INBOX)
    for w in ("old", "new"):
        inbox.put(keys.heartbeat_key(w), b"{}")
    inbox.put(keys.worker_segment_key("old", 0), b"{}\n")
    past = time.time() - 7200
    os.utime(tmp_path / keys.INBOX / keys.heartbeat_key("old"), (past, past))
    assert Retention(store, inbox, LAG, K, forget_workers_seconds=3600).sweep(0) == 1
    assert sorted(inbox.list("")) == sorted(
        [keys.heartbeat_key("new"), keys.worker_segment_key("old", 0)]  # the record stays
    )
    assert Retention(store, inbox, LAG, K, enabled=False).sweep(1) == 0


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
    inbox = store.sub(keys.INBOX)
    signer = Signer(Ed25519PrivateKey.generate(), "r1")
    trust = signer.trust
    pub = Publisher(store, signer, "bf16", anchor_every=K)
    keep = Retention(store, inbox, LAG, K)
    lagging = Follower(store, K, trust)
    counts = []
    for v, s in enumerate(_states(40)):
        pub.publish(s)
        inbox.put(keys.rollout_key(v, "w1", 0), b"batch")
        inbox.put(keys.claim_key(v, 0), b"{}")
        store.put(keys.consumed_key(v, "t"), b"{}")
        keep.sweep(v)
        counts.append(len(store.list("")))  # the inbox's folder included
        if v == 29:
            lagging.sync(29)
    # After warm-up the count repeats with every anchor window: it does not grow.
    assert all(counts[i] == counts[i + K] for i in range(12, len(counts) - K))
    assert max(counts) < 32
    assert inbox.list("w1/") == [keys.rollout_key(v, "w1", 0) for v in (38, 39)]
    assert inbox.list(keys.CLAIMS) == [keys.claim_key(v, 0) for v in (38, 39)]
    assert store.list(keys.CONSUMED) == [keys.consumed_key(v, "t") for v in (38, 39)]
    # Joiner: the newest anchor and the patches after it.
    joiner = Follower(store, K, trust)
    assert joiner.sync() and joiner.version == 39 == latest_version(store, trust)
    assert pulse.state_hash(joiner.state) == read_meta(store, 39, trust).state_hash
    # A follower left at v29 (one anchor window behind the newest anchor, v36):
    # its patches from v32 on are kept; older ones fall back to the anchor.
    assert lagging.sync(39) and lagging.state_hash == read_meta(store, 39, trust).state_hash
    assert read_meta(store, 31, trust) is None and read_meta(store, 32, trust) is not None


def test_a_store_that_refuses_deletes_turns_retention_off(tmp_path, caplog):
    class NoDeletes(LocalStore):
        def delete(self, key):
            raise AccessDenied(f"{self.url}: delete {key}: access denied")

    store, inbox = NoDeletes(tmp_path / "run"), NoDeletes(tmp_path / "inbox")
    for v in range(5):
        inbox.put(keys.rollout_key(v, "w1", 0), b"batch")
    keep = Retention(store, inbox, LAG, K)
    assert keep.sweep(4) == 0 and not keep.enabled
    assert "retention is off" in caplog.text
    assert keep.sweep(5) == 0 and len(inbox.list("w1/")) == 5


@pytest.mark.s3
def test_s3_deletes_in_batches(seaweed, monkeypatch):
    from s3server import make_s3_store

    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    store = make_s3_store(seaweed)
    inbox = store.sub(keys.INBOX)
    for i in range(5):
        inbox.put(keys.rollout_key(0, "w1", i), b"x")
    inbox.delete_many([keys.rollout_key(0, "w1", i) for i in range(4)] + ["nope"])
    assert inbox.list("w1/") == [keys.rollout_key(0, "w1", 4)]
