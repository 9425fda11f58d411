"""Quarantine: a worker whose log-probs do not fit the fleet's is refused."""

import copy

import torch
from test_samples_and_step import (  # noqa: F401 - sqa fixture below
    _episode,
    _rebuild,
    sqa,
)

from colonnade.protocol import GroupRecord
from colonnade.train.quarantine import QuarantineConfig, accumulate, outliers
from colonnade.train.step import StepConfig, policy_logprobs, train_step

CFG = QuarantineConfig(factor=5.0, min_tokens=100)


def _s(tokens, kept, kl):
    return {"tokens": tokens, "kept": kept, "kl_sum": kl * tokens}


def test_outliers_rule():
    honest = {"a": _s(1000, 990, 0.010), "b": _s(1000, 985, 0.012), "c": _s(900, 992, 0.008)}
    assert outliers(honest, CFG) == {}
    liar = {**honest, "x": _s(1000, 950, 1.5)}
    assert list(outliers(liar, CFG)) == ["x"] and "mismatch KL" in outliers(liar, CFG)["x"]
    # Negative k1 (claimed log-probs too low) counts by magnitude.
    assert list(outliers({**honest, "y": _s(1000, 990, -0.9)}, CFG)) == ["y"]
    gated = {**honest, "g": _s(1000, 500, 0.02)}
    assert "gate masked" in outliers(gated, CFG)["g"]
    # Too little evidence, a lone worker, quarantine off: no decision.
    assert outliers({**honest, "x": _s(50, 10, 3.0)}, CFG) == {}
    assert outliers({"x": _s(1000, 10, 3.0)}, CFG) == {}
    assert outliers(liar, QuarantineConfig(factor=0)) == {}
    # Two workers: the honest one is never flagged for the liar's figures.
    assert list(outliers({"a": honest["a"], "x": liar["x"]}, CFG)) == ["x"]
    total = {}
    accumulate(total, {"a": _s(10, 9, 0.1)})
    accumulate(total, {"a": _s(10, 10, 0.1)})
    assert total["a"] == {"tokens": 20, "kept": 19, "kl_sum": 2.0}


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
    by = m["gate_by_worker"]
    assert set(by) == {"honest", "liar"}
    assert abs(by["honest"]["kl_sum"]) / by["honest"]["tokens"] < 1e-4
    assert abs(by["liar"]["kl_sum"]) / by["liar"]["tokens"] > 1.0
    assert sum(w["tokens"] for w in by.values()) == m["tokens"]
    assert list(outliers(by, QuarantineConfig(min_tokens=1))) == ["liar"]


def test_ledger_decides_once_and_remembers():
    from colonnade.train.quarantine import Ledger

    ledger = Ledger(CFG)
    honest = {"a": _s(300, 300, 0.01), "b": _s(300, 299, 0.01)}
    assert not ledger.judge(1, {**honest, "x": _s(50, 50, 2.0)})  # too little evidence yet
    assert ledger.judge(2, {"x": _s(100, 100, 2.0)})  # 150 tokens now: decided
    assert list(ledger.decisions) == ["x"] and ledger.decisions["x"]["version"] == 2
    assert not ledger.judge(3, {"x": _s(100, 100, 2.0)})  # not decided twice
