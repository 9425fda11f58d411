"""A pipeline stage follows the published versions holding its own tensors
only (`rollout/stageweights.py`), and ends with exactly what a whole
worker's follower holds of them."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from colonnade.engine.stages import plan_stages, stage_names, stage_skeleton
from colonnade.model import load_model, publishable_state
from colonnade.model.int8 import Int8Embedding, Int8Linear
from colonnade.model.loading import skeleton
from colonnade.protocol import Follower, Publisher, VersionError, keys
from colonnade.rollout.stageweights import StageFollower
from colonnade.store import LocalStore

VERSIONS = 5  # v0..v4, an anchor every 2


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_dir):
    from signed_runs import _write_signed_run

    store = LocalStore(tmp_path_factory.mktemp("run"))
    signer = _write_signed_run(store, anchor_every=2)
    model, _ = load_model(tiny_dir)
    publisher = Publisher(store, signer, "int8", anchor_every=2)
    gen = torch.Generator().manual_seed(0)
    for v in range(VERSIONS):
        if v:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.02)
        publisher.publish(publishable_state(model))
    return store, signer.trust


def _mine(tiny_dir: str, k: int, n: int = 2):
    config = AutoConfig.from_pretrained(tiny_dir)
    stage = plan_stages(skeleton(tiny_dir), n)[k]
    names = stage_names(*stage_skeleton(config, stage), stage)
    return lambda name: names.local(name) is not None


def _same(part: dict, whole: dict, mine) -> None:
    assert set(part) == {k for k in whole if mine(k)}
    assert all(torch.equal(part[k], whole[k]) for k in part)


def test_each_stage_holds_its_own_tensors_of_every_version(published, tiny_dir):
    store, trust = published
    whole = Follower(store, 2, trust)
    mines = [_mine(tiny_dir, k) for k in range(2)]
    stages = [StageFollower(store, 2, trust, m) for m in mines]
    for v in range(VERSIONS):
        whole.sync(v)
        for follower, mine in zip(stages, mines, strict=True):
            assert follower.sync(v) and follower.version == v
            assert follower.state_hash == whole.state_hash
            _same(follower.state, whole.state, mine)
    # Between them the stages hold every tensor, and neither holds them all.
    held = [set(f.state) for f in stages]
    assert held[0] | held[1] == set(whole.state)
    assert all(h < set(whole.state) for h in held)
    # Kept up from v0, a stage read one anchor and patches after it.
    assert all(f.anchors_read == 1 for f in stages)


def test_a_stage_joins_late_and_falls_back_to_the_anchor(published, tiny_dir):
    store, trust = published
    whole = Follower(store, 2, trust)
    whole.sync(3)
    mine = _mine(tiny_dir, 1)
    late = StageFollower(store, 2, trust, mine)
    late.sync(3)  # the anchor v2, then one patch
    _same(late.state, whole.state, mine)
    # A state the stage does not hold as signed (its base hash is not the
    # patch's): the patch is refused and the stage starts over from v4's anchor.
    late.state_hash = "blake3:" + "0" * 64
    late.sync(4)
    assert late.anchors_read == 2
    whole.sync(4)
    _same(late.state, whole.state, mine)


def test_a_damaged_anchor_is_refused(published, tiny_dir, tmp_path):
    store, trust = published
    copy = LocalStore(tmp_path)
    for key in store.list(""):
        copy.put(key, store.get(key))
    raw = bytearray(copy.get(keys.full_key(2)))
    raw[-1] ^= 1
    copy.put(keys.full_key(2), bytes(raw))
    with pytest.raises(VersionError, match="hash"):
        StageFollower(copy, 2, trust, _mine(tiny_dir, 0)).sync(2)


def test_an_anchor_is_read_one_tensor_at_a_time_as_written(tmp_path):
    from safetensors.torch import save_file

    from colonnade.rollout.stageweights import _read_tensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(3, 4, generator=gen).to(torch.bfloat16),
        "codes": torch.randint(-128, 127, (5, 2), dtype=torch.int8, generator=gen),
        "scale": torch.rand(5, generator=gen),
        "mask": torch.tensor([True, False]),
        "none": torch.empty(0, 3),
    }
    path = tmp_path / "full.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    got = dict(_read_tensors(path))
    assert set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # A file cut short: its last tensor lies past the end, refused.
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(ValueError, match="out of the file"):
        dict(_read_tensors(cut))


@pytest.mark.parametrize("k", [0, 1])
def test_a_stage_holds_its_codes_once_through_every_version(published, tiny_dir, k):
    # The stage's engine runs its follower's codes and the follower keeps
    # the engine's (a stacked sibling's views) in place of its own: after
    # every version one copy of each, holding what a whole worker holds.
    from colonnade.config import WorkerConfig
    from colonnade.model import tied_aliases
    from colonnade.rollout.pipeline import Group
    from colonnade.rollout.stageworker import StageLoader
    from colonnade.rollout.weights import EngineLoader, Weights

    store, trust = published
    model = skeleton(tiny_dir)
    stage = plan_stages(model, 2)[k]
    base = EngineLoader(model, None, "int8", torch.device("cpu"), "torch", tied_aliases(model))
    loader = StageLoader(base, stage, Group("run", "g", ("a", "b")), store, WorkerConfig())
    follower = StageFollower(store, 2, trust, loader.mine())
    weights = Weights(follower, loader)
    whole = Follower(store, 2, trust)
    for v in range(VERSIONS):
        follower.sync(v)
        whole.sync(v)
        weights.load()
        backend = weights.engine.front.stage if k == 0 else weights.engine.stage
        held = backend.held(set(follower.state))
        assert held and all(follower.state[n] is t for n, t in held.items())
        codes = [t for n, t in follower.state.items() if t.dtype == torch.int8]
        assert {n for n, t in follower.state.items() if t.dtype == torch.int8} == set(held)
        # The follower's codes fill their storages exactly (stacked siblings'
        # views fill their set's), and those are the engine's: one copy.
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in codes}
        assert sum(storages.values()) == sum(t.numel() for t in codes)
        layers = [m for m in backend.model.modules() if isinstance(m, Int8Linear | Int8Embedding)]
        assert {m.codes.untyped_storage().data_ptr() for m in layers} == set(storages)
        _same(follower.state, whole.state, loader.mine())
