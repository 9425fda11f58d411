from colonnade.engine import Engine, SamplingParams
from colonnade.engine.torch_backend import TorchBackend
from colonnade.envs import Score, Success, Task, load_environment
from colonnade.protocol.turns import model_turns
from colonnade.rollout import run_episodes
from colonnade.rollout.episodes import Result
from colonnade.rollout.evaluate import evaluate, figures_line, summarize


def test_episodes_through_an_env_are_scored_from_their_own_tokens(tiny):
    model, tok = tiny
    env = load_environment("searchqa", n_clusters=20)
    tasks = list(env.tasks("train")[:4]) * 2  # groups of 2
    params = SamplingParams(max_turn_tokens=12, max_episode_tokens=200)
    results = run_episodes(Engine(TorchBackend(model), tok), env, tasks, params, seed=1)
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
        Engine(TorchBackend(model), tok),
        env,
        env.tasks("test"),
        SamplingParams(temperature=0, max_turn_tokens=6, max_episode_tokens=6),
        batch_size=3,
        progress=lambda d, n, passed: seen.append((d, n, passed)),
    )
    assert out["n"] == 4 and seen[-1] == (4, 4, out["pass_at_1"]) and len(seen) == 2
    assert 0.0 <= out["pass_at_1"] <= 1.0 and "format_ok" in out
    assert "pass_at_k" not in out and "k" not in out


def test_k_samples_a_task_run_consecutively_and_differ(tiny):
    model, tok = tiny
    env = load_environment("smoke", n_tasks=20)
    seen = []
    out = evaluate(
        Engine(TorchBackend(model), tok),
        env,
        env.tasks("test")[:2],
        SamplingParams(temperature=1.0, max_turn_tokens=6, max_episode_tokens=6),
        batch_size=4,
        progress=lambda d, n, _p: seen.append((d, n)),
        k=3,
    )
    assert out["n"] == 2 and out["k"] == 3 and seen == [(4, 6), (6, 6)]
    assert out["pass_at_1"] == out["mean_at_k"] <= out["pass_at_k"]


def _results(solved_per_task: list[list[int]]) -> list[Result]:
    return [
        Result(Task(f"t{i}", "q", ("a",)), None, Score(float(s), {"correct": float(s)}))
        for i, samples in enumerate(solved_per_task)
        for s in samples
    ]


def test_pass_at_k_is_any_success_and_mean_at_k_the_share():
    rule = Success("correct", 1.0, True)
    out = summarize(_results([[0, 0, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]), rule, k=4)
    assert out["n"] == 3 and out["k"] == 4
    assert out["pass_at_k"] == round(2 / 3, 4)  # tasks 0 and 2
    assert out["mean_at_k"] == out["pass_at_1"] == round((0.25 + 0 + 1) / 3, 4)
    line = figures_line(out)
    assert line.startswith("pass@1 0.417 (correct >= 1, declared), pass@4 0.667, mean@4 0.417")
    assert line.endswith("n=3")
