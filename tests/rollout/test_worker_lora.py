"""A worker following a LoRA run: each version's patch rewrites the adapters
alone, and the worker's engine takes them in place, its base untouched."""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.engine import engine_for
from colonnade.model import load_model, publishable_state, sequence_logprobs, skeleton
from colonnade.model.int8 import tied_aliases
from colonnade.model.lora import A_SUFFIX, B_SUFFIX, TARGETS, is_adapter, targets_in
from colonnade.protocol import Follower, Publisher
from colonnade.protocol.signing import Signer
from colonnade.rollout.weights import EngineLoader, Weights
from colonnade.store import LocalStore

CPU = torch.device("cpu")
IDS = [5, 17, 42, 99, 7, 300, 12, 1, 64, 8]


def _lora_states(model, versions: int) -> list[dict[str, torch.Tensor]]:
    """The trainer's states: one frozen base, new adapters every version."""
    base = publishable_state(model)
    gen = torch.Generator().manual_seed(0)
    states = []
    for _ in range(versions):
        adapters = {}
        for name in targets_in(model, TARGETS):
            m = model.get_submodule(name)
            adapters[name + A_SUFFIX] = torch.randn(4, m.in_features, generator=gen) * 0.1
            adapters[name + B_SUFFIX] = torch.randn(m.out_features, 4, generator=gen) * 0.1
        states.append({**base, **adapters})
    return states


class Recording(EngineLoader):
    """The worker's own loader, recording the keys each refresh names."""

    changed: list[set[str]]

    def refresh(self, engine, state, changed, version) -> None:
        self.changed.append(set(changed))
        super().refresh(engine, state, changed, version)


def _logprobs(engine) -> torch.Tensor:
    backend = engine.backend
    if backend.name == "mlx":
        return backend.model.sequence_logprobs(IDS, 1)
    with torch.no_grad():
        return sequence_logprobs(backend.model, IDS, 1)


@pytest.mark.parametrize("kind", ["torch", "mlx"])
def test_a_worker_takes_each_versions_adapters_in_place(kind, tmp_path, tiny_dir):
    if kind == "mlx":
        from colonnade.engine.mlx_backend import mlx_missing

        if mlx_missing():
            pytest.skip(mlx_missing())
    model, tok = load_model(tiny_dir)
    store = LocalStore(tmp_path)
    signer = Signer(Ed25519PrivateKey.generate(), "r1")
    publisher = Publisher(store, signer, "int8", anchor_every=10)
    for state in _lora_states(model, 3):
        publisher.publish(state)
    shell = skeleton(tiny_dir)  # as a worker builds its engine: no fp32 copy
    loader = Recording(shell, tok, "int8", CPU, kind, tied_aliases(shell))
    loader.changed = []
    weights = Weights(Follower(store, anchor_every=10, trust=signer.trust), loader)
    weights.follower.sync(0)
    weights.load()
    engine = weights.engine
    at_v0 = _logprobs(engine)
    for v in (1, 2):
        weights.follower.sync(v)
        weights.load()
        # The patch named the adapters alone, and the engine runs v's adapters.
        assert loader.changed[-1] and all(is_adapter(k) for k in loader.changed[-1])
        fresh = engine_for(load_model(tiny_dir)[0], tok, weights.follower.state, "int8", CPU, kind)
        assert torch.equal(_logprobs(engine), _logprobs(fresh)) and engine.version == v
    assert not torch.equal(_logprobs(engine), at_v0)
