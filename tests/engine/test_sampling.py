import math

import numpy as np
import pytest
import torch

from colonnade.engine import SamplingParams, filtered_logprobs, sample
from colonnade.engine.sampling import mass_below
from colonnade.protocol.draws import draw_key, outside_interval, slot_tasks, uniforms


def _draws(n, seed=0):
    return np.random.default_rng(seed).random(n)


def _lp(logits, **kw):
    return filtered_logprobs(torch.tensor([logits]), SamplingParams(**kw))[0]


def test_temperature_one_is_plain_softmax():
    lp = _lp([1.0, 2.0, 3.0])
    assert torch.allclose(lp, torch.log_softmax(torch.tensor([1.0, 2.0, 3.0]), -1))


def test_temperature_scales_logits():
    lp = _lp([0.0, math.log(4.0)], temperature=2.0)
    assert torch.allclose(lp.exp(), torch.tensor([1 / 3, 2 / 3]))


def test_top_k_renormalizes_over_the_k_best():
    lp = _lp([0.0, 0.0, math.log(3.0)], top_k=2)
    # Ties at the k-th value stay; here both zeros tie, so nothing is cut.
    assert torch.isfinite(lp).all()
    lp = _lp([0.0, math.log(2.0), math.log(3.0)], top_k=2)
    assert lp[0] == -math.inf
    assert torch.allclose(lp[1:].exp(), torch.tensor([0.4, 0.6]))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    lp = _lp(probs.log().tolist(), top_p=0.75)
    assert torch.isfinite(lp[:2]).all() and (lp[2:] == -math.inf).all()
    assert torch.allclose(lp[:2].exp(), torch.tensor([0.625, 0.375]))
    # The most likely token survives any top_p.
    assert torch.isfinite(_lp(probs.log().tolist(), top_p=0.01)[0])


def test_recorded_logprob_is_that_of_the_sampled_distribution():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=0.7, top_k=10)
    tokens, lps, _ = sample(logits, params, _draws(64, 1))
    full = filtered_logprobs(logits, params)
    assert torch.equal(lps, full.gather(-1, tokens[:, None]).squeeze(-1))
    assert torch.isfinite(lps).all()


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    tokens, lps, _ = sample(logits, SamplingParams(temperature=0), _draws(2))
    assert tokens.tolist() == [1, 0]
    assert torch.allclose(lps, torch.log_softmax(logits, -1).max(-1).values)


def test_bad_params_are_refused():
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError):
        SamplingParams(max_turn_tokens=0)


def test_draws_follow_the_filtered_distribution_and_never_a_filtered_token():
    # 40,000 draws from one row: each frequency within 5 standard errors of
    # its probability; top-k's dropped tokens are never drawn.
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 3.0, -5.0]]).expand(40_000, 6).contiguous()
    params = SamplingParams(temperature=1.0, top_k=4)
    tokens, _, _ = sample(logits, params, _draws(40_000, 3))
    freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
    p = filtered_logprobs(logits[:1], params)[0].exp().double()
    assert freq[p == 0].sum() == 0
    se = (p * (1 - p) / len(tokens)).sqrt()
    assert bool(((freq - p).abs() <= 5 * se + 1e-12).all()), (freq, p)


def test_the_token_is_the_inverse_cdf_in_token_id_order():
    # probabilities 0.1, 0.2, 0.3, 0.4: draws pick by where they fall in
    # [0, .1), [.1, .3), [.3, .6), [.6, 1), and `below` is where that starts.
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().expand(6, 4)
    draws = np.array([0.0, 0.0999, 0.1001, 0.35, 0.6001, 0.999999])
    tokens, lps, below = sample(logits, SamplingParams(), draws)
    assert tokens.tolist() == [0, 0, 1, 2, 3, 3]
    assert np.allclose(below.numpy(), [0.0, 0.0, 0.1, 0.3, 0.6, 0.6])
    assert not outside_interval(draws, below.numpy(), lps.numpy()).any()


def test_a_token_not_drawn_by_the_rule_falls_outside_its_interval():
    logits = torch.randn(2000, 300, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(temperature=0.8)
    draws = _draws(2000, 5)
    tokens, lps, below = sample(logits, params, draws)
    assert not outside_interval(draws, below.numpy(), lps.numpy()).any()
    # The second most likely token instead, reported truthfully: always caught.
    logp = filtered_logprobs(logits, params)
    second = logp.topk(2, dim=-1).indices[:, 1]
    swapped = second != tokens
    lp2 = logp.gather(-1, second[:, None]).squeeze(-1)
    out = outside_interval(draws, mass_below(logp, second).numpy(), lp2.numpy())
    assert out[swapped.numpy()].all()
    # The same tokens re-labelled with other draws (another version's):
    # nearly all fall outside.
    other = outside_interval(_draws(2000, 6), below.numpy(), lps.numpy())
    assert other.mean() > 0.5


def test_draws_are_fixed_by_their_names_and_uniform():
    key = draw_key("run", 3, "w1", 7, "task-1", 0)
    assert key == draw_key("run", 3, "w1", 7, "task-1", 0)
    names = [("run", 4, "w1", 7, "task-1", 0), ("run", 3, "w2", 7, "task-1", 0),
             ("run", 3, "w1", 8, "task-1", 0), ("run", 3, "w1", 7, "task-1", 1)]  # fmt: skip
    others = {draw_key(*n) for n in names}
    assert key not in others and len(others) == 4
    u = uniforms(key, range(20_000))
    assert np.array_equal(u, uniforms(key, range(20_000)))
    assert ((u >= 0) & (u < 1)).all()
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert np.abs(counts - 2000).max() < 5 * np.sqrt(2000 * 0.9)


def test_a_slot_decides_its_tasks():
    a = slot_tasks("run", 3, 5, tasks=100, k=8)
    assert a == slot_tasks("run", 3, 5, tasks=100, k=8) and len(set(a)) == 8
    assert a != slot_tasks("run", 3, 6, tasks=100, k=8)
    assert a != slot_tasks("run", 4, 5, tasks=100, k=8)
    assert sorted(slot_tasks("run", 3, 5, tasks=4, k=8)) == [0, 1, 2, 3]
