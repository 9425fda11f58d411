"""A verifiers-shaped environment's own loop through the worker's in-process endpoint.

Two environments written for the tests (tests/vf_envs): `colour`, one turn
with a local rubric, and `lookup`, several turns with a tool. Their
episodes, made by their loops over the OpenAI client against the endpoint,
are the engine's own: each greedy turn is what the engine makes alone on
the stream before it; every token's μ is within the backend's tolerance of
a teacher-forced pass over the whole stitched stream; the draws of a
sampled episode follow from its key at positions that go on across turns;
and what the environment added between turns is masked as its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colonnade.engine import SamplingParams, engine_for
from colonnade.envs import load_environment
from colonnade.model import int8_state, load_model, sequence_logprobs
from colonnade.protocol.draws import draw_key, outside_interval, uniforms
from colonnade.protocol.turns import chat_prompt
from colonnade.rollout.episodes import run_episodes

pytest.importorskip("openai")
CPU = torch.device("cpu")
ENVS = ("vf:vf_envs.colour", "vf:vf_envs.lookup")


@pytest.fixture(scope="module")
def engine(tiny_dir):
    model, tok = load_model(tiny_dir)
    return engine_for(model, tok, int8_state(model), "int8", CPU, "torch", version=3)


def _params(temperature: float) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_turn_tokens=10, max_episode_tokens=120)


def _keys(tasks) -> list[bytes]:
    return [draw_key("r", 3, "w1", 0, t.id, row) for row, t in enumerate(tasks)]


def _segments(mask) -> list[tuple[bool, int, int]]:
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((bool(mask[start]), start, i))
            start = i
    return out


@pytest.mark.parametrize("name", ENVS)
def test_greedy_episodes_through_the_endpoint_are_the_engines_own(engine, name):
    env = load_environment(name)
    tasks = [t for t in env.tasks("train")[:3] for _ in range(2)]
    params = _params(0.0)
    results = run_episodes(engine, env, tasks, params, keys=_keys(tasks))
    turns_seen = 0
    for r in results:
        ep = r.episode
        assert ep.prompt_ids == chat_prompt(engine.tokenizer, env.prompt(r.task))
        assert ep.from_model[0] and len(ep.tokens) == len(ep.logprobs) == len(ep.below)
        stream = list(ep.prompt_ids)
        for mine, start, end in _segments(ep.from_model):
            if mine:  # the engine alone, on the stream before this turn
                alone = engine.generate([stream], [lambda text: None], params)[0]
                assert alone.tokens == ep.tokens[start:end], (name, r.task.id)
                turns_seen += 1
            stream += ep.tokens[start:end]
        assert len(ep.turns) == sum(m for m, _, _ in _segments(ep.from_model))
    if name.endswith("lookup"):  # the reminders and tool replies come between turns
        assert turns_seen > len(results), turns_seen
        assert any(not m for r in results for m in r.episode.from_model)
    # A group's copies are alike under greedy decoding, and scored by the rubric.
    assert results[0].episode.tokens == results[1].episode.tokens
    assert all(r.score.reward in (0.0, 1.0) for r in results)


@pytest.mark.parametrize("name", ENVS)
def test_sampled_episodes_prove_their_draws_and_match_teacher_forcing(engine, name):
    env = load_environment(name)
    tasks = [t for t in env.tasks("train")[:2] for _ in range(3)]
    keys = _keys(tasks)
    results = run_episodes(engine, env, tasks, _params(1.0), keys=keys)
    net = engine.backend.model
    gaps = []
    for r, key in zip(results, keys, strict=True):
        ep = r.episode
        model = np.asarray(ep.from_model, dtype=bool)
        positions = np.flatnonzero(model)
        u = uniforms(key, positions)  # positions in the whole episode, across turns
        lp = np.asarray(ep.logprobs)[positions]
        assert not outside_interval(u, np.asarray(ep.below)[positions], lp).any()
        forced = sequence_logprobs(net, ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        gaps.append(np.abs(forced.detach().numpy()[positions] - lp))
        assert np.all(np.asarray(ep.logprobs)[~model] == 0.0)
    gaps = np.concatenate(gaps)
    assert gaps.max() < 0.1 and gaps.mean() < 0.02, (gaps.max(), gaps.mean())
    # Episodes of one task differ: each row has its own draws.
    assert len({tuple(r.episode.tokens) for r in results[:3]}) > 1


def test_a_verifiers_v1_taskset_runs_one_turn_scored_by_its_own_task(engine):
    """The real library's v1 stack: colonnade plays the harness, the task's
    `@vf.reward` scores; the trainer's recomputation is the worker's score."""
    pytest.importorskip("verifiers.v1")
    from colonnade.protocol.turns import model_turns

    env = load_environment("vf:vf_envs.v1colour")
    assert env.local_rubric and env.max_turns == 1
    tasks = env.tasks("train")[:4]
    params = _params(0.0)
    results = run_episodes(engine, env, tasks, params, keys=_keys(tasks))
    for r in results:
        ep = r.episode
        assert all(ep.from_model) and ep.prompt_ids == chat_prompt(engine.tokenizer,
                                                                   env.prompt(r.task))  # fmt: skip
        alone = engine.generate([ep.prompt_ids], [lambda text: None], params)[0]
        assert alone.tokens == ep.tokens
        turns = model_turns(engine.tokenizer, ep.tokens, ep.from_model, env.stop)
        assert env.score(r.task, turns) == r.score and set(r.score.metrics) == {"correct"}
        assert env.score(r.task, [f"<answer>{r.task.answers[0]}</answer>"]).reward == 1.0


def test_a_turn_past_the_episode_budget_ends_it_unanswered_and_scored_zero(engine):
    env = load_environment("vf:vf_envs.lookup")
    tasks = env.tasks("train")[:2]
    # One turn of 10 tokens, then the reminder would take the episode past 14.
    params = SamplingParams(temperature=0.0, max_turn_tokens=10, max_episode_tokens=14)
    for r in run_episodes(engine, env, tasks, params, keys=_keys(tasks)):
        assert r.episode.finish == "length" and r.score.reward == 0.0
        assert all(r.episode.from_model) and len(r.episode.tokens) <= 14


def test_an_episode_whose_history_is_rewritten_is_refused(engine):
    from colonnade.envs.verifiers import Verifiers
    from colonnade.rollout.endpoint import BrokenEpisode
    from vf_envs import lookup

    class Forgetful(lookup.Lookup):
        """Sends its second turn with the model's first reply replaced."""

        def env_response(self, messages, state):
            messages[-1] = {"role": "assistant", "content": "something else"}
            return {"role": "user", "content": lookup.REMINDER}

    base = lookup.load_environment()
    env = Verifiers("forgetful", Forgetful(base.dataset, base.eval_dataset, base.codes))
    tasks = env.tasks("train")[:1]
    with pytest.raises(BrokenEpisode, match="does not go on from the text before it"):
        run_episodes(engine, env, tasks, _params(0.0), keys=_keys(tasks))


def test_an_episode_not_on_the_tasks_prompt_is_refused(engine):
    from colonnade.envs.verifiers import Verifiers
    from colonnade.rollout.endpoint import BrokenEpisode
    from vf_envs import colour

    base = colour.load_environment()

    class Hinting(type(base)):
        async def rollout(self, client, model, prompt, *args, **kwargs):
            hinted = [
                *prompt[:-1],
                {"role": "user", "content": "Hint: red. " + prompt[-1]["content"]},
            ]
            return await super().rollout(client, model, hinted, *args, **kwargs)

    hinting = Hinting(base.dataset, base.eval_dataset, base.rubric, base.system_prompt)
    env = Verifiers("hinting", hinting)
    tasks = env.tasks("train")[:1]
    with pytest.raises(BrokenEpisode, match="not on the task's prompt"):
        run_episodes(engine, env, tasks, _params(0.0), keys=_keys(tasks))
