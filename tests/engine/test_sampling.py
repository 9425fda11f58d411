import math

import pytest
import torch

from colonnade.engine import SamplingParams, filtered_logprobs, sample


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
    tokens, lps = sample(logits, params, torch.Generator().manual_seed(1))
    full = filtered_logprobs(logits, params)
    assert torch.equal(lps, full.gather(-1, tokens[:, None]).squeeze(-1))
    assert torch.isfinite(lps).all()


def test_greedy_picks_argmax():
    logits = torch.tensor([[0.1, 3.0, 0.2], [5.0, 0.0, 0.0]])
    tokens, lps = sample(logits, SamplingParams(temperature=0), torch.Generator())
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
    tokens, _ = sample(logits, params, torch.Generator().manual_seed(3))
    freq = torch.bincount(tokens, minlength=6).double() / len(tokens)
    p = filtered_logprobs(logits[:1], params)[0].exp().double()
    assert freq[p == 0].sum() == 0
    se = (p * (1 - p) / len(tokens)).sqrt()
    assert bool(((freq - p).abs() <= 5 * se + 1e-12).all()), (freq, p)
