"""Rollouts that wait on a tool service: episodes/s at a service's latency,
with the rows that wait parked beside the batch (`async`) or the batch
waiting for each call (today's path before parking, `run_episodes(...,
async_tools=False)`).

The episodes are a probe's, so that every configuration does the same work
whatever the model writes: each of the first `calls` turns of an episode
(cut at `turn_tokens`, end of sequence ignored) is sent as a query to a real
tool service over HTTP (`colonnade.tools.ToolService`, in this process, on
searchqa's built-in corpus and index), and the signed reply is appended as
searchqa appends its documents; the turn after the last call ends the
episode. Services of each latency run at once; the runs of every
(latency, path) configuration are interleaved and the median kept.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

from colonnade.envs import Score, Task


class ToolProbe:
    """searchqa's prompts and documents, every turn a call (up to `calls`)."""

    name = "toolprobe"
    stop: tuple[str, ...] = ()

    def __init__(self, searchqa, service: str, service_key: str, calls: int):
        self.searchqa, self.calls = searchqa, calls
        self.service, self.service_key = service, service_key

    def tasks(self, split: str) -> Sequence[Task]:
        return self.searchqa.tasks(split)

    def prompt(self, task: Task) -> list[dict[str, str]]:
        return self.searchqa.prompt(task)

    def tool_query(self, task: Task, turns: Sequence[str]) -> str | None:
        if len(turns) > self.calls:
            return None
        return turns[-1].strip()[:200] or task.question

    def tool_result(self, query: str) -> Any:
        return self.searchqa.tool_result(query)

    def tool_reply(self, task: Task, turns: Sequence[str], result: Any) -> str:
        return self.searchqa.tool_reply(task, turns, result)

    def respond(self, task: Task, turns: Sequence[str]) -> str | None:
        return None

    def score(self, task: Task, turns: Sequence[str], results: Sequence | None = None) -> Score:
        return Score(0.0, {"calls": float(len(results or ()))})


def measure_tools(
    engine,
    latencies_ms: Sequence[float],
    tail_ms: float,
    tail_share: float,
    episodes: int,
    calls: int,
    turn_tokens: int,
    repeats: int,
    log=lambda msg: None,
) -> list[dict]:
    """Rows of kind "tools": per latency (a `tail_ms` wait for a `tail_share`
    of calls where latency > 0) and path, the episodes/s of `episodes`
    probe episodes of `calls` calls, each row's share of the async path's
    rate at the first latency (`of_fast`)."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade.engine import SamplingParams
    from colonnade.envs import load_environment
    from colonnade.rollout.episodes import run_episodes
    from colonnade.tools.service import Latency, ToolService

    searchqa = load_environment("searchqa")
    tasks = list(searchqa.tasks("train"))[:episodes]
    params = SamplingParams(
        temperature=1.0,
        max_turn_tokens=turn_tokens,
        max_episode_tokens=(calls + 1) * turn_tokens + calls * 1024,
        ignore_eos=True,
    )
    services, probes = [], {}
    try:
        for ms in latencies_ms:
            latency = Latency(ms / 1e3, tail_ms / 1e3 if ms else 0.0, tail_share if ms else 0.0)
            private = Ed25519PrivateKey.generate()
            service = ToolService(searchqa.tool_result, private, latency=latency).start()
            services.append(service)
            probes[ms] = ToolProbe(searchqa, service.url, service.public_hex, calls)
        shown: dict[tuple[float, bool], list[int]] = {}

        def run(ms: float, parked: bool) -> int:
            results = run_episodes(engine, probes[ms], tasks, params, seed=1, async_tools=parked)
            shown[ms, parked] = [len(r.tools) for r in results]
            return len(results)

        configs = [(ms, parked) for ms in latencies_ms for parked in (False, True)]
        rates: dict[tuple[float, bool], list[float]] = {c: [] for c in configs}
        for i in range(repeats):
            for c in configs:
                log(f"tools: latency {c[0]:g} ms, async {c[1]}, run {i + 1} of {repeats}")
                t = time.perf_counter()
                n = run(*c)
                rates[c].append(n / (time.perf_counter() - t))
    finally:
        for service in services:
            service.close()
    fast = statistics.median(rates[latencies_ms[0], True])
    rows = []
    for ms, parked in configs:
        rate = statistics.median(rates[ms, parked])
        rows.append({
            "kind": "tools",
            "tool_latency_ms": ms,
            "tool_tail_ms": tail_ms if ms else 0.0,
            "tail_share": tail_share if ms else 0.0,
            "async": parked,
            "episodes": len(tasks),
            "calls_per_episode": statistics.fmean(shown[ms, parked]),
            "turn_tokens": turn_tokens,
            "episodes_s": round(rate, 3),
            "of_fast": round(rate / fast, 3),
        })  # fmt: skip
    return rows


def tools_table(rows: list[dict]) -> str:
    head = (
        "| model | latency ms | tail ms | async | episodes/s | of fast async |\n" + "|---" * 6 + "|"
    )
    lines = [
        f"| {r['model']} | {r['tool_latency_ms']:g} | {r['tool_tail_ms']:g} | {r['async']} "
        f"| {r['episodes_s']} | {r['of_fast']} |"
        for r in rows
    ]
    return "\n".join([head, *lines])
