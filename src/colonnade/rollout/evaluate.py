"""Evaluation: pass@1 and the environment's own figures of a model on a split.

pass@1 is the share of episodes the environment's success rule counts as
solved (`colonnade.envs.success_of`: a declared metric or the reward against
a threshold); the output names the rule under `success`. Every other metric
the environment returns is reported as its mean, under its own name, except
`searched`, reported as `search_rate` (the name reports have always used).
"""

from __future__ import annotations

from collections.abc import Sequence

from colonnade.envs import Environment, Success, Task, success_of

from .engine import Engine
from .episodes import Result, run_episodes
from .sampling import SamplingParams

RENAMES = {"searched": "search_rate"}  # per-episode metric -> report name


def summarize(results: Sequence[Result], success: Success) -> dict:
    """pass@1, mean reward, the means of every metric (report names), n, and the rule."""
    out: dict = {}
    if results:
        out["pass_at_1"] = _mean([float(success(r.score)) for r in results])
        out["reward"] = _mean([r.score.reward for r in results])
    names = dict.fromkeys(k for r in results for k in r.score.metrics)
    for metric in names:
        values = [r.score.metrics[metric] for r in results if metric in r.score.metrics]
        out[RENAMES.get(metric, metric)] = _mean(values)
    out["n"] = len(results)
    out["success"] = success.describe()
    return out


def _mean(values: Sequence[float]) -> float:
    return round(sum(values) / len(values), 4)


def evaluate(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Task],
    params: SamplingParams,
    batch_size: int = 32,
    seed: int = 0,
    progress=None,
) -> dict:
    """Run every task once in batches; `progress(done, total)` after each batch."""
    success = success_of(env)
    results: list[Result] = []
    for start in range(0, len(tasks), batch_size):
        batch = tasks[start : start + batch_size]
        results.extend(run_episodes(engine, env, batch, params, seed=seed + start))
        if progress:
            progress(len(results), len(tasks))
    return summarize(results, success)


def figures_line(figs: dict) -> str:
    """One line of an evaluation's figures for a log, its success rule included:
    `pass@1 0.450 (correct >= 1, declared), reward 0.500, format_ok 0.900, n=200`."""
    p = figs.get("pass_at_1")
    head = f"pass@1 {p:.3f}" if isinstance(p, int | float) else "pass@1 n/a"
    if figs.get("success"):
        head += f" ({figs['success']})"
    skip = {"pass_at_1", "n", "success", "temperature", "version"}
    rest = [
        f"{k} {v:.3f}"
        for k, v in figs.items()
        if k not in skip and isinstance(v, int | float) and not isinstance(v, bool)
    ]
    return ", ".join([head, *rest, f"n={figs.get('n')}"])
