"""Off a terminal (output to a file, --no-live) the run's warm start and evals print
progress lines (step, total, loss or pass@1, elapsed, ETA) instead of staying silent."""

import io

import pytest
from rich.console import Console

from colonnade.config import RunConfig
from colonnade.launch import evaluation
from colonnade.launch import run as launch_run
from colonnade.launch.config import eval_sampling, role_configs
from colonnade.protocol import keys
from colonnade.store import LocalStore


def _console() -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=False, width=200), out


@pytest.mark.slow  # builds the tiny model and a 30-step warm start in a fresh cache: ~30 s
def test_warm_start_and_eval_print_progress_lines(tmp_path, monkeypatch):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("COLONNADE_PROGRESS_SECONDS", "0.05")
    cfg = RunConfig(env="smoke", model="tiny", warmstart_steps=30, warmstart_drill_steps=0)
    cfg.eval_n, cfg.eval_batch = 8, 4
    trainer, _ = role_configs(cfg)
    console, out = _console()
    path = launch_run._warm(cfg, trainer, console)
    said = out.getvalue().splitlines()
    steps = [line for line in said if "/30 (" in line and ", loss " in line and "ETA" in line]
    assert steps and all(line.startswith("warm start: ") for line in said)
    assert said[-1] == f"warm start: built {path}"

    console, out = _console()
    store = LocalStore(tmp_path / "store")
    engine = evaluation.model_engine(path, "torch")
    figures = launch_run._eval(cfg, trainer, store, "before", engine, console)
    said = out.getvalue().splitlines()
    assert any(line.startswith("eval before: 4/8 (50%), pass@1 ") for line in said)
    assert said[-1].startswith("eval before (v0): pass@1 ")
    assert figures["n"] == 8 and store.exists(keys.EVAL["before"])


def test_eval_sampling_is_the_trainers_limits_at_the_eval_temperature():
    params = eval_sampling(
        RunConfig(preset="smoke", eval_temperature=0.5, trainer={"preset": "smoke"})
    )
    assert (params.temperature, params.max_turn_tokens, params.max_episode_tokens) == (0.5, 12, 16)
