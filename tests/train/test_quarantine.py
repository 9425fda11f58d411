"""Quarantine: a worker whose log-probs do not fit the fleet's is refused."""

import copy

import pytest
import torch
from test_samples_and_step import (  # noqa: F401 - sqa fixture below
    _episode,
    _rebuild,
    sqa,
)

from colonnade.protocol import GroupRecord
from colonnade.protocol.metrics import add_gate_stats
from colonnade.train.quarantine import QuarantineConfig, like_for_like, outliers, pool
from colonnade.train.quarantine import _weighted_median as _wm
from colonnade.train.step import StepConfig, policy_logprobs, train_step

CFG = QuarantineConfig(factor=5.0, min_tokens=100)


def _s(tokens, kept, kl):
    return {"tokens": tokens, "kept": kept, "kl_sum": kl * tokens}


def _pooled(*steps, version=4):
    """Steps' {worker: {behaviour version: stats}} pooled, each training
    version − 1 into `version`."""
    out = {}
    for step in steps:
        pool(out, version, step)
    return out


def _judged(*steps):
    """outliers() of steps' {worker: {version: stats}} that made version 4."""
    return outliers(like_for_like(_pooled(*steps)), CFG)


def test_outliers_rule():
    honest = {"a": {"3": _s(1000, 990, 0.010)}, "b": {"3": _s(1000, 985, 0.012)},
              "c": {"3": _s(900, 892, 0.008)}}  # fmt: skip
    assert _judged(honest) == {}
    liar = {**honest, "x": {"3": _s(1000, 950, 1.5)}}
    assert list(_judged(liar)) == ["x"] and "mismatch KL" in _judged(liar)["x"]
    # Negative k1 (claimed log-probs too low) counts by magnitude.
    assert list(_judged({**honest, "y": {"3": _s(1000, 990, -0.9)}})) == ["y"]
    gated = {**honest, "g": {"3": _s(1000, 500, 0.02)}}
    assert "gate masked" in _judged(gated)["g"]
    # Too little evidence, a lone worker, quarantine off: no decision.
    assert _judged({**honest, "x": {"3": _s(50, 10, 3.0)}}) == {}
    assert _judged({"x": {"3": _s(1000, 10, 3.0)}}) == {}
    assert outliers(like_for_like(_pooled(liar)), QuarantineConfig(factor=0)) == {}
    # Two workers: the honest one is never flagged for the liar's figures.
    assert list(_judged({"a": honest["a"], "x": liar["x"]})) == ["x"]
    total = {}
    add_gate_stats(total, {"a": _s(10, 9, 0.1)})
    add_gate_stats(total, {"a": _s(10, 10, 0.1)})
    assert total["a"] == {"tokens": 20, "kept": 19, "kl_sum": 2.0}


def test_a_worker_with_older_batches_is_compared_like_for_like():
    # π has moved on from v1, so every worker's v1 rows mismatch more than
    # v3 rows do. Before, a worker whose batches happened to be older than
    # the other's (0.24 against 0.03) was quarantined; an honest one is not.
    stale = {"a": {"1": _s(1000, 990, 0.24)}, "b": {"3": _s(1000, 995, 0.03)}}
    assert like_for_like(_pooled(stale)) == {}  # no lag in common: nothing to judge
    mixed = {"a": {"1": _s(500, 495, 0.24), "3": _s(500, 498, 0.03)},
             "b": {"1": _s(300, 297, 0.25), "3": _s(700, 696, 0.03)}}  # fmt: skip
    assert _judged(mixed) == {}
    t = like_for_like(_pooled(mixed))["a"]
    assert t["tokens"] == 1000 and t["kl"] / 1000 == pytest.approx((0.24 + 0.03) / 2)
    assert t["ref_kl"] / 1000 == pytest.approx((0.25 + 0.03) / 2)
    # A liar among like batches still stands out, at any staleness.
    liar = {**mixed, "x": {"1": _s(500, 480, 2.0)}}
    assert list(_judged(liar)) == ["x"]


def test_workers_are_compared_across_steps_at_the_same_lag():
    # Small steps often hold one worker's batches only (a fault test's run of
    # 56-token steps judged nobody when steps were matched within themselves).
    # Pooled by lag, a step of the honest worker's and a later step of the
    # liar's, both one version behind, are compared.
    honest, liar = {"a": {"3": _s(300, 299, 0.01)}}, {"x": {"4": _s(300, 290, 1.0)}}
    pooled = {}
    pool(pooled, 5, honest)  # trained v4: v3 rows are 1 behind
    pool(pooled, 6, liar)  # trained v5: v4 rows are 1 behind
    assert set(pooled["a"]) == {(1, 3)} and set(pooled["x"]) == {(1, 4)}  # (lag, version)
    assert list(outliers(like_for_like(pooled), CFG)) == ["x"]
    # A forgery that alternates its sign per row is counted by magnitude.
    flip = {"x": {"3": _s(150, 150, 1.0), "2": _s(150, 150, -1.0)}}
    fair = {"a": {"3": _s(150, 150, 0.01), "2": _s(150, 150, 0.01)}}
    assert list(_judged(fair, flip)) == ["x"]


def test_rows_are_judged_by_the_nearest_versions_of_their_lag():
    # A smoke run whose policy moved slowly at first: the honest worker a's
    # lag-1 rows of v0-v2 mismatch 0.001; mid-run, π moves 30-60× faster.
    # Worker w's lag-1 rows of v4 (0.063) were judged against a's early
    # rows when rows were pooled by lag alone, and an honest worker was
    # quarantined; its peers are now a's rows nearest v4.
    pooled = {}
    for v in range(3):
        pool(pooled, v + 2, {"a": {str(v): _s(300, 300, 0.001)}})
    pool(pooled, 6, {"w": {"4": _s(600, 590, 0.063)}})
    pool(pooled, 7, {"a": {"5": _s(300, 295, 0.05)}})
    totals = like_for_like(pooled)
    assert totals["w"]["ref_kl"] / 600 == pytest.approx(0.05)  # v5 is nearest, not v0-v2
    assert outliers(totals, CFG) == {}
    # A liar among the same rows still stands out.
    pool(pooled, 6, {"x": {"4": _s(600, 500, 1.0)}})
    assert list(outliers(like_for_like(pooled), CFG)) == ["x"]
    # Peers farther than the window judge no one.
    far = {}
    pool(far, 2, {"a": {"0": _s(300, 300, 0.001)}})
    pool(far, 8, {"x": {"6": _s(600, 500, 1.0)}})
    assert like_for_like(far, window=2) == {}
    assert list(outliers(like_for_like(far, window=6), CFG)) == ["x"]


def test_a_worker_is_judged_without_its_worst_third_of_steps():
    # Two honest workers, same versions, same steps; w drew tasks where π had
    # moved far in one step (a smoke worker with exact weights stood at
    # 0.064/token against the other's 0.005).
    pooled = {}
    for v in range(1, 5):
        far = 0.30 if v == 4 else 0.004
        pool(pooled, v + 1, {"a": {str(v - 1): _s(100, 100, 0.005)},
                             "w": {str(v - 1): _s(100, 95, far)}})  # fmt: skip
    totals = like_for_like(pooled)
    assert totals["w"]["kl"] / totals["w"]["tokens"] > 5 * 0.005  # pooled: out
    assert sorted(totals["w"]["steps"]) == [2, 3, 4, 5]
    assert outliers(totals, CFG) == {}  # its worst step aside: not
    # A forger that forges every other step stands out all the same...
    for v in range(5, 11):
        forged = 1.0 if v % 2 else 0.005
        pool(pooled, v + 1, {"a": {str(v - 1): _s(100, 100, 0.005)},
                             "x": {str(v - 1): _s(100, 90, forged)}})  # fmt: skip
    why = outliers(like_for_like(pooled), CFG)
    assert list(why) == ["x"] and "worst 2 of 6 steps aside" in why["x"]
    # ...as does one with fewer steps than trim_from, judged whole.
    few = {}
    for v in (1, 2):
        pool(few, v + 1, {"a": {str(v - 1): _s(300, 300, 0.005)},
                          "x": {str(v - 1): _s(300, 290, 1.0)}})  # fmt: skip
    assert list(outliers(like_for_like(few), CFG)) == ["x"]
    # The smoke run that showed it: w alone in two steps where π jumped
    # (0.27 and 1.33/token), 0.0002-0.0003 in its four others.
    spiky = {}
    for v, kl in zip(range(1, 7), (0.0003, 0.0003, 0.0002, 0.0002, 0.27, 1.33), strict=True):
        pool(spiky, v + 1, {"a": {str(v - 1): _s(150, 150, 0.001)},
                            "w": {str(v - 1): _s(300, 300, kl)}})  # fmt: skip
    assert outliers(like_for_like(spiky), CFG) == {}
    # What is not caught: a forger forging in a third of its steps or fewer.
    once = {}
    for v in (1, 2, 3):
        pool(once, v + 1, {"a": {str(v - 1): _s(300, 300, 0.005)},
                           "x": {str(v - 1): _s(300, 290, 1.0 if v == 2 else 0.005)}})  # fmt: skip
    assert outliers(like_for_like(once), CFG) == {}


def test_a_rows_reference_is_the_token_weighted_median_of_its_peers():
    # A peer row of 5 tokens near 0 does not set the reference; a forger
    # among the peers holding under half their tokens does not move it.
    pooled = {}
    pool(pooled, 4, {"w": {"3": _s(300, 300, 0.02)}, "tiny": {"3": _s(5, 5, 0.0001)},
                     "a": {"3": _s(300, 300, 0.02)}, "x": {"3": _s(200, 150, 2.0)}})  # fmt: skip
    totals = like_for_like(pooled)
    assert totals["w"]["ref_kl"] / 300 == pytest.approx(0.02)  # peers: tiny, a, x
    assert list(outliers(totals, CFG)) == ["x"]
    assert _wm([(1.0, 1), (3.0, 1)]) == 2.0 and _wm([(1.0, 1), (3.0, 2)]) == 3.0


def test_forged_logprobs_stand_out_in_the_step(tiny_dir, sqa):  # noqa: F811
    from colonnade.model import load_model

    model, tok = load_model(tiny_dir)
    groups = []
    for i, worker in enumerate(["honest", "liar"]):
        task = sqa.tasks("train")[i]
        eps = [
            _episode(tok, sqa, task, [f"<answer>{task.answers[0]}</answer>"]),
            _episode(tok, sqa, task, ["<answer>aspirin</answer>"]),
        ]
        group = _rebuild(tok, sqa, GroupRecord(task.id, eps))
        with torch.no_grad():
            lp = policy_logprobs(model, group, tok.pad_token_id, 1.0)
        for r, s in enumerate(group):
            s.worker = worker
            n = len(s.from_model)
            # The honest worker reports the policy's log-probs; the liar claims
            # near-certainty for every token it wrote.
            s.behaviour_logp = lp[r, -n:].tolist() if worker == "honest" else [-0.01] * n
        groups.append(group)
    m = train_step(model, torch.optim.AdamW(model.parameters()), copy.deepcopy(groups),
                   tok.pad_token_id, StepConfig())  # fmt: skip
    by = m.gate_by_worker
    assert set(by) == {"honest", "liar"}
    assert abs(by["honest"]["kl_sum"]) / by["honest"]["tokens"] < 1e-4
    assert abs(by["liar"]["kl_sum"]) / by["liar"]["tokens"] > 1.0
    assert sum(w["tokens"] for w in by.values()) == m.tokens
    # The same figures per behaviour version, which quarantine compares.
    per_v = m.gate_by_version
    assert {w: sum(s["tokens"] for s in vs.values()) for w, vs in per_v.items()} == {
        w: s["tokens"] for w, s in by.items()
    }
    totals = like_for_like(_pooled(per_v))
    assert list(outliers(totals, QuarantineConfig(min_tokens=1))) == ["liar"]


def test_ledger_decides_once_and_remembers():
    from colonnade.train.quarantine import Ledger

    ledger = Ledger(CFG)
    honest = {"a": {"0": _s(300, 300, 0.01)}, "b": {"0": _s(300, 299, 0.01)}}
    assert not ledger.judge(1, {**honest, "x": {"0": _s(50, 50, 2.0)}})  # too little yet
    step = {**honest, "x": {"0": _s(100, 100, 2.0)}}
    assert ledger.judge(2, step)  # 150 tokens now: decided
    assert list(ledger.decisions) == ["x"] and ledger.decisions["x"].version == 2
    assert not ledger.judge(3, step)  # not decided twice
