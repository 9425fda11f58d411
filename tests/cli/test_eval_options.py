"""`colonnade eval`: k samples a task, sample completions, a run's turn and token limits,
and progress lines when stderr is not a terminal."""

import json

import pytest

from colonnade.cli.main import main

EVAL = ["eval", "--model", "tiny", "--env", "smoke", "-n", "4", "--precision", "fp32"]


def test_k_samples_show_and_the_run_presets_limits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    assert main([*EVAL, "-k", "3", "--show", "2", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["n"] == 4 and figures["k"] == 3
    assert figures["pass_at_1"] == figures["mean_at_k"] <= figures["pass_at_k"]
    assert "k" not in figures["greedy"] and figures["greedy"]["n"] == 4  # one greedy a task
    # The smoke run preset's limits, as `colonnade run --preset smoke` evaluates.
    assert figures["limits"] == {"max_turn_tokens": 12, "max_episode_tokens": 16}
    samples = figures["samples"]
    assert len(samples) == 2 and samples[0]["task"] == samples[1]["task"]  # k of one task
    assert set(samples[0]) == {"task", "question", "completion", "reward", "solved", "finish"}


def test_human_output_names_limits_and_prints_samples(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    monkeypatch.setenv("COLONNADE_PROGRESS_SECONDS", "0.01")
    args = [*EVAL, "--show", "1", "--no-greedy", "--max-turn-tokens", "5", "--preset", "demo"]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert out.startswith("--- sample 1: task ") and "question: " in out
    assert "limits: 5 tokens a turn, 384 an episode (run preset demo)" in out
    assert "pass@1" in out and "pass_at_k" not in out
    # stderr is no terminal here: progress comes as lines, the first at the first batch.
    assert "eval: 4/4 (100%), sampled pass@1 " in err


def test_bad_counts_fail_in_one_line(capsys):
    assert main([*EVAL, "-k", "0"]) == 2
    assert "-k" in capsys.readouterr().err


@pytest.mark.slow  # builds the tiny model in a fresh cache: ~40 s on 2 cores
def test_a_runs_config_gives_env_and_limits(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('preset = "smoke"\n[trainer]\nmax_turn_tokens = 7\n')
    args = ["eval", "--model", "tiny", "--config", str(run_toml), "-n", "2", "--no-greedy"]
    assert main([*args, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["limits"] == {"max_turn_tokens": 7, "max_episode_tokens": 16}
    assert figures["n"] == 2 and figures["success"] == "correct >= 1, declared"  # smoke's rule
