"""A damaged full anchor, and damaged patches around it: typed errors, never a wrong state.

Ten versions of a tiny state are published to a local store (an anchor every
4: v0, v4, v8). The v4 anchor's payload is then damaged in place (bit flips,
truncations, extensions, another anchor's bytes) or a patch is. A follower
must raise VersionError, hold only states that hash to their meta, reach the
newest version through the next intact anchor (a follower that keeps up
crosses a damaged anchor on its patch, never reading it), and fall back
from a bad patch to the anchor where the anchor leads to the target. A
worker whose only anchor never verifies installs nothing and uploads
nothing: it counts the version as unverified and waits, backing off to 30 s,
for the trainer to put its own back (protocol 7: it never exits on what
anyone could have written), and runs once it is back.
"""

import copy
import random
from types import SimpleNamespace

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade import pulse
from colonnade.protocol import Follower, Publisher, VersionError, keys, read_meta
from colonnade.protocol.signing import Signer
from colonnade.store import LocalStore

VERSIONS, K = 10, 4
FLIPS = 40  # random bit flips per damaged object


def _states(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    w = {"a.weight": torch.randn(16, 32, generator=g), "norm": torch.ones(32)}
    out = [w]
    for _ in range(n - 1):
        w = {k: v.clone() for k, v in w.items()}
        w["a.weight"][torch.rand(16, 32, generator=g) < 0.05] += 0.01
        out.append(w)
    return out


SIGNER = Signer(Ed25519PrivateKey.generate(), "r1")  # the trainer's, in `run`
TRUST = SIGNER.trust


@pytest.fixture
def run(tmp_path):
    """(store, metas) with versions 0..VERSIONS-1 published."""
    store = LocalStore(tmp_path)
    pub = Publisher(store, SIGNER, "int8", anchor_every=K)
    metas = [pub.publish(s).meta for s in _states(VERSIONS)]
    assert [m.version for m in metas if m.kind == "full"] == [0, 4, 8]
    return store, metas


def damages(data: bytes, seed: int) -> list[tuple[str, bytes]]:
    """Ways an object can be damaged in the store or on the wire."""
    rng = random.Random(seed)
    out = []
    for _ in range(FLIPS):
        bad = bytearray(data)
        bad[rng.randrange(len(bad))] ^= 1 << rng.randrange(8)
        out.append(("flip", bytes(bad)))
    for cut in (0, 1, 8, len(data) // 2, len(data) - 1):
        out.append((f"truncated to {cut}", data[:cut]))
    # Longer than meta.json says: once an untyped ObjectTooLarge (see below).
    out += [("one byte appended", data + b"\0"), ("4 KiB appended", data + bytes(4096))]
    return out


def held_ok(f: Follower, metas) -> bool:
    """The follower holds nothing, or a state hashing to its version's meta."""
    if f.state is None:
        return f.version is None
    sha = pulse.state_hash(f.state)
    return sha == f.state_hash == metas[f.version].state_hash


def synced(store, v: int) -> Follower:
    f = Follower(store, K, TRUST)
    f.sync(v)
    return f


def fork(follower: Follower) -> Follower:
    """Another follower at the same version, with its own copy of the state
    (a follower may patch its state in place)."""
    other = copy.copy(follower)
    other.state = {k: t.clone() for k, t in follower.state.items()}
    return other


@pytest.mark.timeout(120)
def test_a_damaged_anchor_is_refused_and_the_next_anchor_recovers(run):
    store, metas = run
    key = keys.full_key(4)
    good = store.get(key)
    before, after = synced(store, 3), synced(store, 5)  # synced while v4 was intact
    caught = 0
    for what, bad in [*damages(good, seed=4), ("v0's anchor", store.get(keys.full_key(0)))]:
        store.put(key, bad)
        for target in range(4, 8):  # every version built on the v4 anchor
            f = Follower(store, K, TRUST)
            with pytest.raises(VersionError):
                f.sync(target)
            assert held_ok(f, metas), what
            caught += 1
        # Crossing the anchor from v3 needs only v4's patch: the damaged
        # full state is never read by a follower that keeps up.
        crossing = fork(before)
        assert crossing.sync(5) and crossing.version == 5 and held_ok(crossing, metas), what
        assert crossing.anchors_read == before.anchors_read, what
        # A follower past the anchor does not need it either; the newest version
        # comes from the intact v8 anchor.
        past = fork(after)
        assert past.sync(7) and past.version == 7 and held_ok(past, metas), what
        newest = Follower(store, K, TRUST)
        assert newest.sync() and newest.version == VERSIONS - 1, what
        assert held_ok(newest, metas), what
    store.put(key, good)
    assert synced(store, 6).version == 6
    assert caught == 4 * (FLIPS + 8)


@pytest.mark.timeout(120)
def test_a_damaged_patch_falls_back_to_the_anchor(run):
    store, metas = run
    for v in (2, 6):  # a patch before the anchor the target builds on, one after it
        key = keys.patch_key(v)
        good = store.get(key)
        for what, bad in damages(good, seed=v):
            store.put(key, bad)
            _check_fallback(store, metas, v, what)
        store.put(key, good)


def _check_fallback(store, metas, v: int, what: str) -> None:
    """Patch v is damaged: targets the next anchor leads to are reached, others refused."""
    anchor = v - v % K + K
    f = synced(store, v - 1)
    with pytest.raises(VersionError):  # no way around patch v to v+1
        f.sync(v + 1)
    assert f.version == v - 1 and held_ok(f, metas), what
    read = f.bytes_read
    assert f.sync(anchor + 1) and f.version == anchor + 1, what
    assert held_ok(f, metas), what
    # It read the anchor, not only patches.
    assert f.bytes_read - read >= metas[anchor].anchor_bytes, what


@pytest.mark.timeout(60)
@pytest.mark.parametrize("damage", ["flip", "truncate", "extend", "meta", "forged meta"])
def test_a_worker_waits_out_an_anchor_that_never_verifies(tmp_path, monkeypatch, damage,
                                                          signed_run):  # fmt: skip
    import colonnade.rollout.weights as weights_mod
    import colonnade.rollout.worker as worker_mod
    from colonnade.config import WorkerConfig
    from colonnade.protocol.reader import open_run
    from colonnade.rollout.weights import EngineLoader
    from colonnade.rollout.worker import Worker

    store = LocalStore(tmp_path)
    signer = signed_run(store, anchor_every=K)
    pub = Publisher(store, signer, "int8", anchor_every=K)
    metas = [pub.publish(s).meta for s in _states(3)]
    key = keys.full_key(0)
    good_anchor, good_meta = store.get(key), store.get(keys.meta_key(0))
    data = bytearray(good_anchor)
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    if damage == "meta":  # the anchor's meta.json itself, cut short
        store.put(keys.meta_key(0), good_meta[:-9])
    elif damage == "forged meta":  # another anchor, with a meta.json signed by another key
        forger = Signer(Ed25519PrivateKey.generate(), "r1")
        forged = Publisher(LocalStore(tmp_path / "forged"), forger, "int8", anchor_every=K)
        forged.publish(_states(1, seed=9)[0])
        store.put(key, forged.store.get(key))
        store.put(keys.meta_key(0), forged.store.get(keys.meta_key(0)))
    else:
        bad = {"flip": bytes(data), "truncate": data[:-7], "extend": data + b"x"}[damage]
        store.put(key, bad)
        assert read_meta(store, 0, signer.trust).kind == "full"

    delays = []
    tries = 20

    def backoff(log, what, attempt, error, sleep=None):
        # The schedule the worker would sleep, without sleeping it; after
        # `tries` the test stops it (it would wait on for ever).
        delays.append(min(30.0, 0.5 * 2**attempt))
        if len(delays) == tries:
            w.stop.requested = True

    monkeypatch.setattr(worker_mod, "backoff", backoff)
    # The engine is faked: built from whatever state the follower installs.
    monkeypatch.setattr(weights_mod, "engine_for", lambda *a, **k: SimpleNamespace(version=a[6]))
    w = Worker(WorkerConfig(store=str(tmp_path), id="w1"), store)
    view = open_run(store)
    # The parts setup() builds, without the model; the loop needs nothing else here.
    w.wire(view.spec, view.trust, view.inbox, EngineLoader(None, None, "int8", None, "torch", {}))
    w._loop()  # returns only because the test stopped it
    assert len(delays) == tries and max(delays) == 30.0  # backs off, never gives up
    assert w.tally.counts["unverified"] == tries
    assert w.weights.follower.state is None and w.weights.engine is None and w.batches == 0
    assert view.inbox.list("") == []
    # The trainer puts its own back: the worker installs the newest version.
    store.put(key, good_anchor)
    store.put(keys.meta_key(0), good_meta)
    w.sync()
    assert w.running_version == 2 and held_ok(w.weights.follower, metas)
