"""Evaluation: pass@1 and search figures of a model on an environment split."""

from __future__ import annotations

from collections.abc import Sequence

from colonnade.envs import Environment, Task

from .engine import Engine
from .episodes import Result, run_episodes
from .sampling import SamplingParams

METRICS = ("correct", "searched", "search_success", "turns", "format_ok")
REPORT_KEYS = {  # report name -> per-episode metric
    "pass_at_1": "correct",
    "search_rate": "searched",
    "search_success": "search_success",
    "turns": "turns",
    "format_ok": "format_ok",
}


def summarize(results: Sequence[Result]) -> dict[str, float]:
    """Means of the per-episode metrics under their report names, and n."""
    out: dict[str, float] = {}
    for name, metric in REPORT_KEYS.items():
        values = [r.score.metrics[metric] for r in results if metric in r.score.metrics]
        if values:
            out[name] = round(sum(values) / len(values), 4)
    out["n"] = len(results)
    return out


def evaluate(
    engine: Engine,
    env: Environment,
    tasks: Sequence[Task],
    params: SamplingParams,
    batch_size: int = 32,
    seed: int = 0,
    progress=None,
) -> dict[str, float]:
    """Run every task once in batches; `progress(done, total)` after each batch."""
    results: list[Result] = []
    for start in range(0, len(tasks), batch_size):
        batch = tasks[start : start + batch_size]
        results.extend(run_episodes(engine, env, batch, params, seed=seed + start))
        if progress:
            progress(len(results), len(tasks))
    return summarize(results)
