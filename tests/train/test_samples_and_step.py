"""Rebuilding untrusted episodes on the trainer, and one DPPO step on a real model."""

import copy

import pytest
import torch

from colonnade.envs import Success, load_environment
from colonnade.protocol import EpisodeRecord, GroupRecord
from colonnade.protocol.turns import chat_prompt
from colonnade.train.samples import Rejected, rebuild_group
from colonnade.train.step import StepConfig, policy_logprobs, train_step


@pytest.fixture(scope="module")
def sqa():
    return load_environment("searchqa", n_clusters=40)


def _episode(tok, env, task, turns):
    """What an honest worker sends for these model turns."""
    tokens, mask = [], []
    for i, turn in enumerate(turns):
        ids = tok.encode(turn, add_special_tokens=False)
        tokens += ids
        mask += [True] * len(ids)
        reply = env.respond(task, turns[: i + 1])
        if reply is None:
            break
        ids = tok.encode(reply, add_special_tokens=False)
        tokens += ids
        mask += [False] * len(ids)
    return EpisodeRecord(tokens, mask, [-0.5 if m else 0.0 for m in mask], "done")


def _rebuild(tok, env, group, version=3):
    train_ids = {t.id for t in env.tasks("train")}
    return rebuild_group(tok, env, group, version, env.stop, 4096, train_ids)


def test_rewards_are_recomputed_from_the_tokens(tiny, sqa):
    _, tok = tiny
    task = sqa.tasks("train")[0]
    good = _episode(
        tok, sqa, task, [f"<search>{task.question}</search>", f"<answer>{task.answers[0]}</answer>"]
    )
    guess = _episode(tok, sqa, task, ["<answer>aspirin</answer>"])
    samples = _rebuild(tok, sqa, GroupRecord(task.id, [good, guess]))
    assert [s.score.reward for s in samples] == [1.0, 0.0]
    assert samples[0].score.metrics["searched"] == 1.0
    prompt = chat_prompt(tok, sqa.prompt(task))
    assert samples[0].ids == prompt + good.tokens and samples[0].prompt_len == len(prompt)
    assert samples[0].version == 3


def test_forged_tool_output_and_foreign_tasks_are_rejected(tiny, sqa):
    _, tok = tiny
    task = sqa.tasks("train")[0]
    ep = _episode(
        tok, sqa, task, [f"<search>{task.question}</search>", f"<answer>{task.answers[0]}</answer>"]
    )
    forged = copy.deepcopy(ep)
    # The worker "retrieves" a document of its own that holds the answer.
    fake = tok.encode(
        f"\n<information>\nDoc 1: {task.answers[0]}\n</information>\n", add_special_tokens=False
    )
    first_env = ep.from_model.index(False)
    end_env = first_env + ep.from_model[first_env:].index(True)
    forged.tokens[first_env:end_env] = fake
    forged.from_model[first_env:end_env] = [False] * len(fake)
    forged.logprobs[first_env:end_env] = [0.0] * len(fake)
    with pytest.raises(Rejected, match="differs"):
        _rebuild(tok, sqa, GroupRecord(task.id, [ep, forged]))
    with pytest.raises(Rejected, match="not a training task"):
        _rebuild(tok, sqa, GroupRecord(sqa.tasks("test")[0].id, [ep]))
    # Model tokens claimed as tool tokens: the structure no longer replays.
    relabel = copy.deepcopy(ep)
    relabel.from_model[1] = False
    with pytest.raises(Rejected):
        _rebuild(tok, sqa, GroupRecord(task.id, [relabel]))


def test_policy_logprobs_left_padded_match_one_by_one(tiny, sqa):
    model, tok = tiny
    from colonnade.model.logprobs import sequence_logprobs

    tasks = sqa.tasks("train")[:2]
    eps = [
        _episode(
            tok, sqa, tasks[0], [f"<search>{tasks[0].question}</search>", "<answer>x</answer>"]
        ),
        _episode(tok, sqa, tasks[1], ["<answer>y</answer>"]),
    ]
    samples = [
        _rebuild(tok, sqa, GroupRecord(t.id, [e]))[0] for t, e in zip(tasks, eps, strict=True)
    ]
    with torch.no_grad():
        lp = policy_logprobs(model, samples, tok.pad_token_id, 1.0)
        for r, s in enumerate(samples):
            want = sequence_logprobs(model, s.ids, s.prompt_len)
            assert torch.allclose(lp[r, -len(want) :], want, atol=1e-4)


def test_a_step_raises_the_rewarded_episode_and_skips_flat_groups(tiny_dir, sqa):
    from colonnade.model import load_model

    model, tok = load_model(tiny_dir)
    task = sqa.tasks("train")[1]
    good = _episode(tok, sqa, task, [f"<answer>{task.answers[0]}</answer>"])
    bad = _episode(tok, sqa, task, ["<answer>aspirin</answer>"])
    group = _rebuild(tok, sqa, GroupRecord(task.id, [good, bad]))
    # On-policy: behaviour log-probs are the model's own.
    with torch.no_grad():
        lp = policy_logprobs(model, group, tok.pad_token_id, 1.0)
    for r, s in enumerate(group):
        n = len(s.from_model)
        s.behaviour_logp = lp[r, -n:].tolist()
    flat = _rebuild(tok, sqa, GroupRecord(task.id, [bad, bad]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def model_sums(lp):
        out = []
        for r, s in enumerate(group):
            n = len(s.from_model)
            out.append(float(lp[r, -n:][torch.tensor(s.from_model)].sum()))
        return out

    before = model_sums(lp)
    m = train_step(model, opt, [group, flat], tok.pad_token_id, StepConfig())
    assert m.groups == 2 and m.groups_skipped == 1 and m.episodes == 4
    assert m.masked_fraction == 0.0 and abs(m.mismatch_kl) < 1e-4
    assert m.reward_mean == 0.25 and m.pass_rate == 0.25
    with torch.no_grad():
        after = model_sums(policy_logprobs(model, group, tok.pad_token_id, 1.0))
    assert after[0] > before[0] and after[1] < before[1]
    # The pass rate is the environment's success rule, not reward > 0.
    strict = StepConfig(success=Success(None, 2.0, True))
    assert train_step(model, opt, [group, flat], tok.pad_token_id, strict).pass_rate == 0.0
    by_metric = StepConfig(success=Success("correct", 1.0, True))
    assert train_step(model, opt, [group, flat], tok.pad_token_id, by_metric).pass_rate == 0.25


def test_a_step_on_the_published_weights_sees_the_workers_policy(tiny_dir, sqa):
    """Behaviour log-probs from an int8 engine (a worker's): the fp32 π differs
    from them by the quantization; run on the published weights it does not,
    and the update still lands on the fp32 masters."""
    from colonnade import pulse
    from colonnade.engine.loader import engine_for
    from colonnade.model import load_model, publishable_state, tied_aliases
    from colonnade.train.policy import weights_as_published

    model, tok = load_model(tiny_dir)
    worker, _ = load_model(tiny_dir)
    aliases = tied_aliases(worker)
    state = pulse.prepare(publishable_state(worker), "int8")
    engine = engine_for(worker, tok, state, "int8", torch.device("cpu"), aliases=aliases)
    task = sqa.tasks("train")[1]
    group = _rebuild(
        tok,
        sqa,
        GroupRecord(
            task.id,
            [
                _episode(tok, sqa, task, [f"<answer>{task.answers[0]}</answer>"]),
                _episode(tok, sqa, task, ["<answer>aspirin</answer>"]),
            ],
        ),
    )
    with torch.no_grad():
        lp = policy_logprobs(engine.backend.model, group, tok.pad_token_id, 1.0)
    for r, s in enumerate(group):
        s.behaviour_logp = lp[r, -len(s.from_model) :].tolist()
    masters = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        fp32_gap = (policy_logprobs(model, group, tok.pad_token_id, 1.0) - lp).abs().max()
        with weights_as_published(model, "int8"):
            gap = (policy_logprobs(model, group, tok.pad_token_id, 1.0) - lp).abs().max()
    # What is left is the engine's bf16 rounding of activations in its matmuls.
    assert gap < 0.01 and gap < fp32_gap / 2
    for n, p in model.named_parameters():  # the masters are back, bit for bit
        assert torch.equal(p, masters[n]), n

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    fp32 = train_step(copy.deepcopy(model), opt, [group], tok.pad_token_id, StepConfig())
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    m = train_step(model, opt, [group], tok.pad_token_id, StepConfig(published="int8"))
    assert abs(m.mismatch_kl) < abs(fp32.mismatch_kl) / 2
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, masters[n])]
    assert moved  # the fp32 masters took the update
    assert not torch.equal(
        pulse.published_value(model.lm_head.weight, "int8"), model.lm_head.weight
    )
