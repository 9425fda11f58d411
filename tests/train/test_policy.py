"""The trained model's forward: chunked log-probs, checkpointing, bf16, the snapshot."""

import copy

import torch

from colonnade.model import tied_aliases
from colonnade.train.distributed import Dist
from colonnade.train.policy import Policy, build_policy, full_state


def _batch(vocab, b=3, t=24, gen=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :5] = 0  # a left-padded row
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, positions, ids[:, -gen:]


def _grads(policy, batch):
    policy.zero_grad(set_to_none=True)
    lp = policy(*batch)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in policy.named_parameters()}


def test_chunked_logprobs_equal_the_plain_forward(tiny):
    lm = copy.deepcopy(tiny[0])
    batch = _batch(lm.config.vocab_size)
    whole, g_whole = _grads(Policy(lm, chunk_tokens=10_000), batch)
    chunked, g_chunked = _grads(Policy(lm, chunk_tokens=6), batch)  # 2 positions a chunk
    with torch.no_grad():
        out = lm(input_ids=batch[0], attention_mask=batch[1], position_ids=batch[2])
        ref = torch.log_softmax(out.logits[:, -11:-1].float(), -1).gather(-1, batch[3][..., None])
    assert torch.allclose(whole, ref.squeeze(-1), atol=1e-5)
    assert torch.allclose(chunked, whole, atol=1e-6)
    for n, g in g_whole.items():
        assert torch.allclose(g_chunked[n], g, atol=1e-6), n


def test_gradient_checkpointing_changes_no_gradient(tiny):
    batch = _batch(tiny[0].config.vocab_size, seed=1)
    plain = build_policy(copy.deepcopy(tiny[0]), Dist(), bf16=False, grad_ckpt=False)
    ckpt = build_policy(copy.deepcopy(tiny[0]), Dist(), bf16=False, grad_ckpt=True)
    plain.train()
    ckpt.train()
    lp1, g1 = _grads(plain, batch)
    lp2, g2 = _grads(ckpt, batch)
    assert torch.allclose(lp1, lp2, atol=1e-6)
    for n, g in g1.items():
        assert torch.allclose(g2[n], g, atol=1e-5), n


def test_bf16_computes_in_bf16_and_keeps_fp32_masters(tiny):
    batch = _batch(tiny[0].config.vocab_size, seed=2)
    fp32 = build_policy(copy.deepcopy(tiny[0]), Dist(), bf16=False, grad_ckpt=False)
    bf16 = build_policy(copy.deepcopy(tiny[0]), Dist(), bf16=True, grad_ckpt=True)
    lp32, _ = _grads(fp32, batch)
    lp16, grads = _grads(bf16, batch)
    assert all(p.dtype == torch.float32 for p in bf16.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert lp16.dtype == torch.float32
    assert not torch.equal(lp16, lp32)  # it did compute in bf16 ...
    assert (lp16 - lp32).abs().max() < 0.1  # ... close to fp32


def test_full_state_is_a_bf16_copy_without_tied_duplicates(tiny):
    lm = copy.deepcopy(tiny[0])
    aliases = tied_aliases(lm)
    policy = build_policy(lm, Dist(), bf16=False, grad_ckpt=False)
    state = full_state(policy, Dist(), aliases)
    assert set(state) == {k for k in lm.state_dict() if k not in aliases}
    assert all(t.dtype == torch.bfloat16 for t in state.values() if t.is_floating_point())
    name = next(iter(state))
    before = state[name].clone()
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(1.0)
    assert torch.equal(state[name], before)  # the next step cannot touch a snapshot
