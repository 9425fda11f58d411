"""Evaluation: pass@1 and the environment's own figures of a model on a split.

pass@1 is the share of episodes the environment's success rule counts as
solved (`colonnade.envs.success_of`: a declared metric or the reward against
a threshold); the output names the rule under `success`. Every other metric
the environment returns is reported as its mean, under its own name, or the
`report` name the environment declares for it (`colonnade.envs.Metric`:
searchqa's `searched` is `search_rate`, the name reports have always used).

With k samples per task (`colonnade eval -k`), pass@k is the share of tasks
with at least one success among their k samples (the unbiased estimator of
Chen et al. 2021, arXiv:2107.03374, with n = k samples reduces to that), and
mean@k the mean over tasks of the share of their k samples that succeed:
pass@1 estimated from k samples a task, which is what `pass_at_1` is then too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from colonnade.engine import Engine, SamplingParams
from colonnade.envs import Environment, Metric, Success, Task, metrics_of, success_of

from .episodes import Result, run_episodes


def summarize(
    results: Sequence[Result], success: Success, k: int = 1, declared: Sequence[Metric] = ()
) -> dict:
    """pass@1, mean reward, the means of every metric (under the report names
    `declared` gives, `metrics_of(env)`), n, and the rule;
    with k > 1 (results hold k consecutive samples of each task) pass@k and mean@k too.
    `n` counts tasks."""
    out: dict = {}
    if results:
        out["pass_at_1"] = _mean([float(success(r.score)) for r in results])
        if k > 1:
            per_task = [
                [success(r.score) for r in results[i : i + k]] for i in range(0, len(results), k)
            ]
            out["pass_at_k"] = _mean([float(any(s)) for s in per_task])
            out["mean_at_k"] = _mean([sum(s) / len(s) for s in per_task])
        out["reward"] = _mean([r.score.reward for r in results])
    renames = {m.name: m.key for m in declared}
    names = dict.fromkeys(k for r in results for k in r.score.metrics)
    for metric in names:
        values = [r.score.metrics[metric] for r in results if metric in r.score.metrics]
        out[renames.get(metric, metric)] = _mean(values)
    out["n"] = -(-len(results) // k)
    if k > 1:
        out["k"] = k
    out["success"] = success.describe()
    return out


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 4)


Progress = Callable[[int, int, float], None]


def episodes(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Task],
    params: SamplingParams,
    batch_size: int = 32,
    seed: int = 0,
    progress: Progress | None = None,
    k: int = 1,
) -> list[Result]:
    """k episodes of every task, a task's k consecutive, in batches of `batch_size`
    episodes; `progress(episodes done, episodes in all, pass@1 so far)` after each."""
    success = success_of(env)
    todo = [t for t in tasks for _ in range(k)]
    results: list[Result] = []
    solved = 0
    for start in range(0, len(todo), batch_size):
        batch = run_episodes(engine, env, todo[start : start + batch_size], params, seed + start)
        results.extend(batch)
        solved += sum(success(r.score) for r in batch)
        if progress:
            progress(len(results), len(todo), solved / len(results))
    return results


def evaluate(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Task],
    params: SamplingParams,
    batch_size: int = 32,
    seed: int = 0,
    progress: Progress | None = None,
    k: int = 1,
    show: int = 0,
) -> dict:
    """The figures of k episodes of every task (`episodes`, `summarize`); with
    `show`, the first `show` episodes as `samples` (`sample_of`)."""
    results = episodes(engine, env, tasks, params, batch_size, seed, progress, k)
    rule = success_of(env)
    figures = summarize(results, rule, k, metrics_of(env))
    if show:
        figures["samples"] = [sample_of(engine.tokenizer, r, rule) for r in results[:show]]
    return figures


def sample_of(tokenizer, result: Result, success: Success) -> dict:
    """One episode as people read it (eval --show, the run's report)."""
    ep = result.episode
    return {
        "task": result.task.id,
        "question": result.task.question,
        "completion": tokenizer.decode(ep.tokens, skip_special_tokens=True),
        "reward": result.score.reward,
        "solved": bool(success(result.score)),
        "finish": ep.finish,
    }


def figures_line(figs: dict) -> str:
    """One line of an evaluation's figures for a log, its success rule included:
    `pass@1 0.450 (correct >= 1, declared), reward 0.500, format_ok 0.900, n=200`."""
    p = figs.get("pass_at_1")
    head = f"pass@1 {p:.3f}" if isinstance(p, int | float) else "pass@1 n/a"
    if figs.get("success"):
        head += f" ({figs['success']})"
    if isinstance(figs.get("pass_at_k"), int | float):
        head += (
            f", pass@{figs['k']} {figs['pass_at_k']:.3f}, mean@{figs['k']} {figs['mean_at_k']:.3f}"
        )
    skip = {"pass_at_1", "pass_at_k", "mean_at_k", "k", "n", "success", "temperature", "version"}
    rest = [
        f"{k} {v:.3f}"
        for k, v in figs.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
    ]
    return ", ".join([head, *rest, f"n={figs.get('n')}"])
