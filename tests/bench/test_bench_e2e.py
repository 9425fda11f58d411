"""bench e2e: its time-to-target rule on known rows, and one quick run of all cases."""

import json
from dataclasses import replace

import pytest

from colonnade.bench.e2e import main, summarize, time_to_target
from colonnade.protocol.metrics import TrainerRow, WorkerRow

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane


def _rows(passes, step=2.0, start=100.0):
    return [
        TrainerRow(time=start + step * (i + 1), version=i + 1, step_seconds=step,
                   wait_seconds=step / 4, pass_rate=p, episodes=64)
        for i, p in enumerate(passes)
    ]  # fmt: skip


def test_time_to_target_needs_a_window_of_versions():
    rows = _rows([0.1, 0.9, 0.2, 0.8, 0.9, 0.9])
    # 0.9 alone at v2 is not enough; v4..v6 average 0.867.
    assert time_to_target(rows, 0.8) == 12.0
    assert time_to_target(rows, 0.8, steady=True) == 10.0  # from the end of v1
    assert time_to_target(rows, 0.95) is None and time_to_target([], 0.5) is None


def test_summarize_rates():
    rows = _rows([0.5] * 5)
    workers = {"w1": [WorkerRow(0.0, 0, episodes=100)], "w2": [WorkerRow(0.0, 0, episodes=60)]}
    s = summarize(rows, workers, 0.5)
    assert s["train_seconds"] == 10.0 and s["episodes_generated_per_s"] == 16.0
    assert s["wait_fraction"] == 0.25 and s["episodes_trained_per_s"] == 32.0
    first_slow = _rows([0.5] * 5)
    first_slow[0] = replace(first_slow[0], wait_seconds=2.0)  # all of v1 waiting for the fleet
    s = summarize(first_slow, {}, 0.5)
    assert s["wait_fraction"] == 0.4 and s["steady_wait_fraction"] == 0.25


def test_quick_run_reports_every_case(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    (tmp_path / "cache").mkdir()
    assert main(["--quick", "--json", "--out", str(tmp_path / "runs"), "--target", "0.01"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["max_lag"], r["workers"]) for r in rows] == [(2, 2), (0, 2), (2, 1), (0, 1)]
    for r in rows:
        assert r["versions"] == 4 and r["episodes_generated_per_s"] > 0
        assert 0 <= r["wait_fraction"] <= 1 and 0 <= r["steady_wait_fraction"] <= 1
