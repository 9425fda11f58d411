"""Rollouts that prove their randomness: honest batches pass the trainer's
free check, and each forger below fails it."""

import copy

import numpy as np
import pytest
import torch

from colonnade.engine import SamplingParams, engine_for
from colonnade.engine.sampling import filtered_logprobs
from colonnade.envs import load_environment
from colonnade.model import int8_state, load_model
from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch
from colonnade.protocol.draws import batch_tasks, draw_key, forged_draws
from colonnade.rollout import run_episodes

RUN, WORKER, PER_BATCH, GROUP = "run-1", "w1", 2, 3
PARAMS = SamplingParams(temperature=1.0, max_turn_tokens=12, max_episode_tokens=40)


@pytest.fixture(scope="module")
def made(tiny_dir):
    """(engine, env, train task ids, batches made honestly for slots 0..5 of v4)."""
    model, tok = load_model(tiny_dir)
    engine = engine_for(model, tok, int8_state(model), "int8", torch.device("cpu"), version=4)
    env = load_environment("smoke")
    train = [t.id for t in env.tasks("train")]
    return engine, env, train, [_honest(engine, env, train, slot) for slot in range(6)]


def _honest(engine, env, train, slot, version=4):
    by_id = {t.id: t for t in env.tasks("train")}
    ids = batch_tasks(RUN, version, slot, train, PER_BATCH)
    keys = [draw_key(RUN, version, WORKER, slot, i, r) for i in ids for r in range(GROUP)]
    tasks = [by_id[i] for i in ids for _ in range(GROUP)]
    results = run_episodes(engine, env, tasks, PARAMS, keys=keys)
    groups = []
    for g, task_id in enumerate(ids):
        eps = [r.episode for r in results[g * GROUP : (g + 1) * GROUP]]
        records = [EpisodeRecord(e.tokens, e.from_model, e.logprobs, e.finish, e.below)
                   for e in eps]  # fmt: skip
        groups.append(GroupRecord(task_id, records))
    return RolloutBatch(WORKER, version, 0, groups, {}, "torch", slot)


def _check(batch, train):
    return forged_draws(batch, RUN, train, PER_BATCH, sampled=True)


def test_honest_batches_pass(made):
    _, _, train, batches = made
    assert all(_check(b, train) is None for b in batches)
    assert (
        sum(e.from_model.count(True) for b in batches for g in b.groups for e in g.episodes) > 200
    )


def _swap_to_second(engine, batch, every: int):
    """Every `every`-th model token replaced by the second most likely one,
    reported truthfully (its log-prob and the mass below it); the episode is
    cut there (what follows would have been sampled after another token)."""
    from colonnade.engine.sampling import mass_below

    out = copy.deepcopy(batch)
    model = engine.backend.model
    swapped = 0
    for g in out.groups:
        prompt = None
        for ep in g.episodes:
            model_at = [i for i, m in enumerate(ep.from_model) if m]
            if len(model_at) < every:
                continue
            at = model_at[every - 1]
            if prompt is None:
                prompt = _prompt_ids(engine, g.task_id)
            ids = torch.tensor([prompt + ep.tokens[:at]])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[0, -1:].float()
            logp = filtered_logprobs(logits, PARAMS)
            top = logp.topk(2, dim=-1).indices[0]
            second = int(top[1]) if int(top[0]) == ep.tokens[at] else int(top[0])
            ep.tokens = [*ep.tokens[:at], second]
            ep.from_model = ep.from_model[: at + 1]
            ep.logprobs = [*ep.logprobs[:at], float(logp[0, second])]
            ep.below = [*ep.below[:at], float(mass_below(logp, torch.tensor([second]))[0])]
            ep.finish = "length"
            swapped += 1
    return out, swapped


def _prompt_ids(engine, task_id):
    from colonnade.protocol.turns import chat_prompt

    env = load_environment("smoke")
    task = next(t for t in env.tasks("train") if t.id == task_id)
    return chat_prompt(engine.tokenizer, env.prompt(task))


def test_a_token_swapped_for_the_second_most_likely_is_caught(made):
    engine, _, train, batches = made
    for batch in batches[:3]:
        forged, swapped = _swap_to_second(engine, batch, every=3)
        assert swapped > 0
        assert "outside the intervals" in _check(forged, train)


def test_episodes_relabelled_with_another_version_or_slot_are_caught(made):
    _, _, train, batches = made
    for batch in batches:
        newer = copy.deepcopy(batch)
        newer.version += 1
        newer.groups = [GroupRecord(i, g.episodes) for i, g in zip(
            batch_tasks(RUN, newer.version, newer.slot, train, PER_BATCH), batch.groups,
            strict=True)]  # fmt: skip
        assert "outside the intervals" in _check(newer, train)
    # Another slot: its tasks differ (a worker cannot choose the tasks it likes).
    moved = copy.deepcopy(batches[0])
    moved.slot = 1
    assert "are not the ones slot 1" in _check(moved, train)


def test_a_worker_that_reports_wrong_log_probs_is_caught(made):
    # Every log-prob claimed e times smaller: the draw falls outside the
    # shrunken interval for about 1 - 1/e of the tokens.
    _, _, train, batches = made
    liar = copy.deepcopy(batches[0])
    for g in liar.groups:
        for ep in g.episodes:
            ep.logprobs = [lp - 1.0 if m else lp for lp, m in zip(ep.logprobs, ep.from_model,
                                                                 strict=True)]  # fmt: skip
    assert "outside the intervals" in _check(liar, train)


def test_greedy_runs_check_the_tasks_only(made):
    _, _, train, batches = made
    greedy = copy.deepcopy(batches[0])
    for g in greedy.groups:
        for ep in g.episodes:
            ep.below = [0.0] * len(ep.tokens)
    assert forged_draws(greedy, RUN, train, PER_BATCH, sampled=False) is None
    assert forged_draws(greedy, RUN, train, PER_BATCH, sampled=True) is not None


def test_the_draws_of_a_row_are_uniform_across_many_rows():
    # The property the interval check rests on: a token's draw is uniform in
    # its interval, so a forger's chance of landing inside a wrong one is its width.
    from colonnade.protocol.draws import uniforms

    u = np.concatenate([uniforms(draw_key(RUN, 1, WORKER, s, "t", r), range(50))
                        for s in range(20) for r in range(10)])  # fmt: skip
    assert abs(u.mean() - 0.5) < 0.01 and abs((u < 0.1).mean() - 0.1) < 0.01
