from colonnade.envs import load_environment
from colonnade.rollout import Engine, SamplingParams, model_turns, run_episodes
from colonnade.rollout.evaluate import evaluate


def test_episodes_through_an_env_are_scored_from_their_own_tokens(tiny):
    model, tok = tiny
    env = load_environment("searchqa", n_clusters=20)
    tasks = list(env.tasks("train")[:4]) * 2  # groups of 2
    params = SamplingParams(max_turn_tokens=12, max_episode_tokens=200)
    results = run_episodes(Engine(model, tok), env, tasks, params, seed=1)
    assert len(results) == 8
    for r in results:
        turns = model_turns(tok, r.episode.tokens, r.episode.from_model, env.stop)
        assert turns == r.episode.turns
        assert env.score(r.task, turns) == r.score
        assert set(r.score.metrics) >= {"correct", "searched", "format_ok", "turns"}


def test_evaluate_reports_means_and_progress(tiny):
    model, tok = tiny
    env = load_environment("smoke", n_tasks=20)
    seen = []
    out = evaluate(
        Engine(model, tok),
        env,
        env.tasks("test"),
        SamplingParams(temperature=0, max_turn_tokens=6, max_episode_tokens=6),
        batch_size=3,
        progress=lambda d, n: seen.append((d, n)),
    )
    assert out["n"] == 4 and seen[-1] == (4, 4) and len(seen) == 2
    assert 0.0 <= out["pass_at_1"] <= 1.0 and "format_ok" in out
