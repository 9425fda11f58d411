"""Which tensors a worker loads into its engine after the follower moves on."""

from types import SimpleNamespace

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import colonnade.rollout.worker as worker_module
from colonnade.config import WorkerConfig
from colonnade.protocol import Follower, Publisher
from colonnade.protocol.signing import Signer
from colonnade.rollout.worker import Worker
from colonnade.store import LocalStore


def _versions():
    gen = torch.Generator().manual_seed(0)
    v0 = {"a": torch.randn(8, 16, generator=gen), "b": torch.randn(8, 16, generator=gen)}
    v1 = {**v0, "a": v0["a"] + 0.5}  # only "a" moves
    v2 = {**v1, "b": v1["b"] + 0.5}  # only "b" moves
    return [v0, v1, v2]


def test_a_fetch_that_failed_half_way_still_gets_every_change_loaded(tmp_path, monkeypatch):
    # The follower reached v1 in a fetch that then failed (so the engine never
    # loaded v1), and v2 in the next: the engine must load what changed from
    # the state it holds (v0), "a" too, not only what v2's patch rewrote.
    store = LocalStore(tmp_path)
    signer = Signer(Ed25519PrivateKey.generate(), "r1")
    pub = Publisher(store, signer, "int8", anchor_every=10)
    for s in _versions():
        pub.publish(s)
    loaded = []
    monkeypatch.setattr(
        worker_module, "refresh", lambda engine, state, *a: loaded.append(set(a[-2]))
    )
    monkeypatch.setattr(worker_module, "engine_for", lambda *a, **k: SimpleNamespace(version=0))
    w = Worker(WorkerConfig(store=str(tmp_path), id="w1"), store)
    w.spec = SimpleNamespace(precision="int8")
    w.model = w.tok = w.aliases = w.device = None
    w.follower = Follower(store, anchor_every=10, trust=signer.trust)
    w.follower.sync(0)
    w._load_weights()  # the engine is built on v0
    w.follower.sync(1)  # ...the fetch that failed after this
    w.follower.sync(2)
    w._load_weights()
    assert loaded == [{"a", "a::scale", "b", "b::scale"}]
    w._load_weights()  # nothing new since
    assert loaded[-1] == set()
