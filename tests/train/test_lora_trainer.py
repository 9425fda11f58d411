"""LoRA on the trainer: adapters on a frozen base, what a version publishes,
what a step moves, what a checkpoint holds, and the same adapters on 2 ranks."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade import pulse
from colonnade.model import lora, skeleton, tied_aliases
from colonnade.protocol.signing import Signer
from colonnade.pulse.quant import is_adapter
from colonnade.store import LocalStore
from colonnade.train.checkpoint import Checkpointer
from colonnade.train.distributed import Dist
from colonnade.train.policy import build_policy, full_state, weights_as_published
from ports import free_port

SPEC = lora.LoraSpec(rank=4, alpha=12.0)  # scale 3: not a power of two on purpose


def _policy(tiny, spec=SPEC, seed=0):
    lm = copy.deepcopy(tiny[0])
    aliases = tied_aliases(lm)
    policy = build_policy(lm, Dist(), False, False, adapters=spec, seed=seed)
    return policy, aliases


def _batch(vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (2, 16), generator=g)
    ones = torch.ones_like(ids)
    return ids, ones, ones.cumsum(-1) - 1, ids[:, -6:]


def _step(policy, opt, seed):
    opt.zero_grad()
    policy(*_batch(policy.lm.config.vocab_size, seed)).sum().backward()
    opt.step()


def _opt(policy):
    return torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=1e-2)


def test_adapters_start_as_the_base_and_only_they_train(tiny):
    policy, _ = _policy(tiny)
    base = copy.deepcopy(tiny[0])
    batch = _batch(base.config.vocab_size)
    plain = build_policy(base, Dist(), False, False)
    assert torch.allclose(policy(*batch), plain(*batch), atol=1e-6)  # B starts at zero
    trained = {n for n, p in policy.named_parameters() if p.requires_grad}
    assert trained and all(is_adapter(n) for n in trained)
    n_linear = len(lora.targets_in(tiny[0], SPEC.targets))
    assert len(trained) == 2 * n_linear
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    opt = _opt(policy)
    _step(policy, opt, 0)
    for n, p in policy.named_parameters():
        if not is_adapter(n):
            assert torch.equal(p, before[n]), n  # the base is frozen
        elif n.endswith(lora.B_SUFFIX):
            assert not torch.equal(p, before[n]), n  # B moves first (A's gradient is B's)
    assert not torch.allclose(policy(*batch), plain(*batch), atol=1e-6)  # the step moved π
    assert len(opt.state) == len(trained)  # Adam's moments for the adapters alone


def test_a_version_publishes_folded_bf16_adapters_beside_the_int8_base(tiny):
    policy, aliases = _policy(tiny)
    _step(policy, _opt(policy), 0)
    state = full_state(policy, Dist(), aliases)
    published = pulse.prepare(state, "int8")
    pairs = lora.adapted(published)
    assert len(pairs) == len(lora.targets_in(tiny[0], SPEC.targets))
    for module, (a, b) in pairs.items():
        assert published[a].dtype == published[b].dtype == torch.bfloat16  # never int8
        assert a + pulse.SCALE_SUFFIX not in published
        m = policy.lm.get_submodule(module)
        assert torch.equal(published[b], (m.lora_B.weight * SPEC.scale).to(torch.bfloat16))
    assert published["model.layers.0.self_attn.q_proj.weight"].dtype == torch.int8
    # The base is the model's as before: a patch between versions is adapters only.
    plain = pulse.prepare(full_state(build_policy(copy.deepcopy(tiny[0]), Dist(), False, False),
                                     Dist(), aliases), "int8")  # fmt: skip
    for k, t in plain.items():
        assert torch.equal(published[k], t), k


def test_the_forward_as_published_is_the_workers_model(tiny):
    """π at the published point (int8 base, bf16 folded adapters) equals a
    plain float model holding the published state dequantized and merged."""
    policy, aliases = _policy(tiny)
    opt = _opt(policy)
    for s in range(3):
        _step(policy, opt, s)
    published = pulse.prepare(full_state(policy, Dist(), aliases), "int8")
    merged = lora.merge(pulse.dequantize_state(published))
    ref = copy.deepcopy(tiny[0])
    ref.load_state_dict({k: v.float() for k, v in merged.items()}, strict=False)
    ref_policy = build_policy(ref, Dist(), False, False)
    batch = _batch(ref.config.vocab_size, 7)
    with torch.no_grad(), weights_as_published(policy, "int8"):
        got = policy(*batch)
    assert torch.allclose(got, ref_policy(*batch), atol=2e-5)


def test_a_checkpoint_holds_the_adapters_and_their_moments_alone(tiny, tmp_path):
    store = LocalStore(tmp_path / "store")
    signer = Signer(Ed25519PrivateKey.generate(), "r1")
    a, aliases = _policy(tiny)
    opt_a = _opt(a)
    _step(a, opt_a, 0)
    saver = Checkpointer(store, a, opt_a, Dist(), tmp_path / "staging", aliases, signer)
    saver.save(2)
    saver.finish()
    shards = [k for k in store.list("trainer/checkpoints/2/") if k.endswith(".safetensors")]
    saved = sum(store.size(k) for k in shards)
    adapters = sum(p.numel() * 4 for p in a.parameters() if p.requires_grad)
    base = sum(p.numel() * 4 for p in a.parameters() if not p.requires_grad)
    assert saved < 3 * adapters + base / 10  # weights + two moments, no base
    b, _ = _policy(tiny, seed=5)  # other adapters until loaded
    opt_b = _opt(b)
    Checkpointer(store, b, opt_b, Dist(), tmp_path / "staging", aliases, signer).load(2)
    _step(a, opt_a, 1)
    _step(b, opt_b, 1)
    for (n, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), n


def _rank(rank: int, world: int, port: int, model_dir: str, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        where = Dist(rank=rank, world=world, device=torch.device("cpu"), backend="gloo")
        skel = skeleton(model_dir)
        aliases = tied_aliases(skel)
        policy = build_policy(skel, where, False, False, source=model_dir, adapters=SPEC, seed=3)
        opt = _opt(policy)
        _step(policy, opt, 0)
        state = full_state(policy, where, aliases)
        if rank == 0:
            pulse_state = {k: v.float() for k, v in state.items()}
            from safetensors.torch import save_file

            save_file(pulse_state, str(Path(out) / "state.safetensors"))
        trained = sorted(n for n, p in policy.named_parameters() if p.requires_grad)
        (Path(out) / f"trained-{rank}.json").write_text(json.dumps(trained))
    finally:
        dist.destroy_process_group()


@pytest.mark.procs
def test_two_ranks_from_a_skeleton_train_the_same_adapters_as_one(tiny, tiny_dir, tmp_path):
    from safetensors.torch import load_file

    mp.spawn(_rank, args=(2, free_port(), str(tiny_dir), str(tmp_path)), nprocs=2)
    got = load_file(str(tmp_path / "state.safetensors"))
    one, aliases = _policy(tiny, seed=3)
    _step(one, _opt(one), 0)
    ref = full_state(one, Dist(), aliases)
    assert set(got) == set(ref)
    for k, t in ref.items():
        # fp32 sums reduced across ranks differ in the last bits; bf16 rounding may flip one
        assert torch.allclose(got[k], t.float(), rtol=1e-2, atol=1e-4), k
    trained = [json.loads((tmp_path / f"trained-{r}.json").read_text()) for r in (0, 1)]
    assert trained[0] == trained[1] and all(is_adapter(n) for n in trained[0])


def test_with_bf16_compute_the_frozen_base_is_kept_in_bf16(tiny):
    lm = copy.deepcopy(tiny[0])
    policy = build_policy(lm, Dist(), True, False, adapters=SPEC)
    dtypes = {n: p.dtype for n, p in policy.named_parameters()}
    assert all((t == torch.float32) == is_adapter(n) for n, t in dtypes.items()), dtypes
    assert policy.lm.lm_head.weight is policy.lm.model.embed_tokens.weight  # still tied
    opt = _opt(policy)
    _step(policy, opt, 0)
    assert all(p.grad is None for p in policy.parameters() if not p.requires_grad)


def test_a_publisher_keeping_the_base_takes_the_adapters_alone(tiny, tmp_path):
    from colonnade.protocol import Follower, Publisher, keys
    from colonnade.protocol.weights import VersionError

    policy, aliases = _policy(tiny)
    signer = Signer(Ed25519PrivateKey.generate(), "r1")
    store = LocalStore(tmp_path / "store")
    pub = Publisher(store, signer, "int8", anchor_every=10)
    pub.keep_rest = True
    pub.publish(full_state(policy, Dist(), aliases))
    opt = _opt(policy)
    for s in range(2):
        _step(policy, opt, s)
        part = full_state(policy, Dist(), aliases, adapters_only=True)
        assert part and all(is_adapter(k) for k in part)
        meta = pub.publish(part).meta
    whole = pulse.prepare(full_state(policy, Dist(), aliases), "int8")
    assert meta.state_hash == pulse.state_hash(whole, "blake3")  # the same version as a full one
    follower = Follower(store, 10, signer.trust)
    follower.sync()
    assert follower.version == 2 and follower.state_hash == meta.state_hash
    # A patch carries the adapters alone.
    header = pulse.read_header(store.get(keys.patch_key(2)))
    assert header["tensors"] and all(is_adapter(e["name"]) for e in header["tensors"])
    with pytest.raises(VersionError, match="lacks"):
        pub.publish({"no.such.lora_A.weight": torch.zeros(2, 2)})
