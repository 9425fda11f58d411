"""Micro-batches by a token budget, dealt to ranks, and the step's samples as tensors."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from colonnade.envs.base import Score
from colonnade.train.batching import Packed, micro_inputs, pack, plan_micro_batches
from colonnade.train.samples import Sample


def test_sorted_by_length_and_within_budget():
    lengths = [10, 50, 12, 48, 11, 49]
    (plan,) = plan_micro_batches(lengths, micro_tokens=100)
    assert plan == [[1, 5], [3, 2], [4, 0]]  # 50+49, 48+12, 11+10: longest first
    for batch in plan:
        assert max(lengths[i] for i in batch) * len(batch) <= 100


def test_a_sample_over_the_budget_gets_a_batch_of_its_own():
    (plan,) = plan_micro_batches([500, 10, 10], micro_tokens=100)
    assert plan == [[0], [1, 2]]


@given(
    st.lists(st.integers(1, 300), min_size=0, max_size=40),
    st.integers(1, 1000),
    st.integers(1, 4),
)
def test_every_sample_once_and_equal_counts_per_rank(lengths, budget, ranks):
    plan = plan_micro_batches(lengths, budget, ranks)
    assert len(plan) == ranks
    assert len({len(p) for p in plan}) == 1
    seen = sorted(i for p in plan for b in p for i in b)
    assert seen == list(range(len(lengths)))
    for p in plan:
        for b in p:
            if len(b) > 1:
                assert max(lengths[i] for i in b) * len(b) <= budget


def test_ranks_get_balanced_work():
    lengths = [100] * 8
    plan = plan_micro_batches(lengths, 200, ranks=2)
    work = [sum(len(b) for b in p) for p in plan]
    assert work == [4, 4]


def _sample(n_prompt, n_gen, seed):
    rng = random.Random(seed)
    return Sample(
        task_id="t",
        version=0,
        prompt_len=n_prompt,
        ids=[rng.randrange(100) for _ in range(n_prompt + n_gen)],
        from_model=[rng.random() < 0.8 for _ in range(n_gen)],
        behaviour_logp=[-rng.random() for _ in range(n_gen)],
        score=Score(reward=0.0, metrics={}),
    )


def test_packed_rebuilds_every_sample_on_its_rank():
    samples = [_sample(5 + i, 3 + 2 * i, i) for i in range(7)]
    pairs = [(s, 0.5 - i / 10) for i, s in enumerate(samples)]
    packed = pack(pairs, micro_tokens=30, ranks=2)
    again = Packed.from_tensors([t.clone() for t in packed.tensors()])
    found = {}
    for r in range(2):
        for j in range(again.micro_count):
            for i, row in zip(again.micro(r, j), again.rows(again.micro(r, j)), strict=True):
                found[i] = row
    assert sorted(found) == list(range(7))
    for i, (s, a) in enumerate(pairs):
        ids, fm, mu, adv = found[i]
        assert ids == s.ids and fm == s.from_model and adv == pytest.approx(a)
        assert mu == pytest.approx(s.behaviour_logp)


def test_micro_inputs_right_align_the_generated_tokens():
    rows = [([1, 2, 3, 4, 5], [True, False], [-0.1, -0.2], 1.0), ([7, 8, 9], [True], [-0.3], -1.0)]
    x = micro_inputs(rows, pad_id=0, device="cpu")
    assert x.ids.tolist() == [[1, 2, 3, 4, 5], [0, 0, 7, 8, 9]]
    assert x.mask.tolist() == [[1] * 5, [0, 0, 1, 1, 1]]
    assert x.positions[1].tolist() == [0, 0, 0, 1, 2]
    assert x.targets.tolist() == [[4, 5], [8, 9]]
    assert x.model_mask.tolist() == [[True, False], [False, True]]
    assert x.adv.tolist() == [[1.0, 1.0], [0.0, -1.0]]
    assert torch.allclose(x.behaviour, torch.tensor([[-0.1, -0.2], [0.0, -0.3]]))
