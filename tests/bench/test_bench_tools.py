"""The tools rows of `colonnade bench rollout` (bench/tools.py): every probe
episode makes its calls to a real service, whichever path waits for them."""

import pytest

from colonnade.bench.tools import measure_tools, tools_table
from colonnade.engine import Engine
from colonnade.engine.torch_backend import TorchBackend


def test_every_probe_episode_calls_the_service_on_both_paths(tiny):
    model, tok = tiny
    engine = Engine(TorchBackend(model), tok)
    rows = measure_tools(engine, [0.0, 30.0], tail_ms=300.0, tail_share=0.5, episodes=4,
                         calls=2, turn_tokens=4, repeats=1)  # fmt: skip
    assert [(r["tool_latency_ms"], r["async"]) for r in rows] == [
        (0.0, False), (0.0, True), (30.0, False), (30.0, True)
    ]  # fmt: skip
    for r in rows:
        assert r["kind"] == "tools" and r["episodes"] == 4 and r["calls_per_episode"] == 2
        assert r["episodes_s"] > 0 and r["of_fast"] == pytest.approx(
            r["episodes_s"] / rows[1]["episodes_s"], rel=0.01
        )
    # The fast service has no tail; the slow one's is as asked.
    assert rows[0]["tool_tail_ms"] == 0 and rows[2]["tool_tail_ms"] == 300.0
    table = tools_table([{"model": "tiny", **r} for r in rows])
    assert table.count("\n") == 5 and "| tiny | 30 | 300 | True |" in table
