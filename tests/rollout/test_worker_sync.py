"""Which tensors a worker loads into its engine after the follower moves on."""

from types import SimpleNamespace

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import Follower, Publisher
from colonnade.protocol.signing import Signer
from colonnade.rollout.weights import Weights
from colonnade.store import LocalStore


def _versions():
    gen = torch.Generator().manual_seed(0)
    v0 = {"a": torch.randn(8, 16, generator=gen), "b": torch.randn(8, 16, generator=gen)}
    v1 = {**v0, "a": v0["a"] + 0.5}  # only "a" moves
    v2 = {**v1, "b": v1["b"] + 0.5}  # only "b" moves
    return [v0, v1, v2]


class Loader:
    """The engine loader's two calls, recorded: built once, then the keys refreshed."""

    def __init__(self):
        self.built, self.loaded = [], []

    def build(self, state, version):
        self.built.append(version)
        return SimpleNamespace(version=version)

    def refresh(self, engine, state, changed, version):
        self.loaded.append(set(changed))
        engine.version = version


def test_a_fetch_that_failed_half_way_still_gets_every_change_loaded(tmp_path):
    # The follower reached v1 in a fetch that then failed (so the engine never
    # loaded v1), and v2 in the next: the engine must load what changed from
    # the state it holds (v0), "a" too, not only what v2's patch rewrote.
    store = LocalStore(tmp_path)
    signer = Signer(Ed25519PrivateKey.generate(), "r1")
    pub = Publisher(store, signer, "int8", anchor_every=10)
    for s in _versions():
        pub.publish(s)
    loader = Loader()
    w = Weights(Follower(store, anchor_every=10, trust=signer.trust), loader)
    w.follower.sync(0)
    w.load()  # the engine is built on v0
    assert loader.built == [0] and loader.loaded == [] and w.running_version == 0
    w.follower.sync(1)  # ...the fetch that failed after this
    w.follower.sync(2)
    w.load()
    assert loader.loaded == [{"a", "a::scale", "b", "b::scale"}] and w.running_version == 2
    w.load()  # nothing new since
    assert loader.loaded[-1] == set() and loader.built == [0]
