"""`colonnade eval --env rg:<dataset> --env-arg ...` on the tiny preset, and its errors."""

import json
import os
import sys

import pytest

from colonnade.cli.main import main

if os.environ.get("CI") is None:  # CI installs the test extra, which has it: never skip there
    pytest.importorskip("reasoning_gym")

EVAL = ["eval", "--model", "tiny", "--env", "rg:basic_arithmetic", "--env-arg", "size=30"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_eval_of_an_rg_dataset_on_the_tiny_preset(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    args = [*EVAL, "--env-arg", "max_terms=2", "-n", "3", "--no-greedy", "--precision", "fp32"]
    assert main([*args, "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["n"] == 3 and 0.0 <= figures["pass_at_1"] <= figures["format_ok"] + 1e-9
    assert figures["success"] == "reward >= 1, declared"
    assert set(figures) >= {"reward", "format_ok", "turns", "temperature"}


def test_bad_env_args_and_a_missing_package_fail_in_one_line(monkeypatch, capsys):
    assert main([*EVAL, "--env-arg", "nope=1"]) == 2
    assert "rg:basic_arithmetic has no setting nope" in _error_line(capsys)
    assert main([*EVAL, "--env-arg", "size"]) == 2
    assert "expected KEY=VALUE" in _error_line(capsys)
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # import now raises ImportError
    assert main(EVAL) == 2
    assert "pip install 'colonnade[tasks]'" in _error_line(capsys)


def test_warmstart_and_trainer_take_env_args_too(tmp_path, capsys):
    ws = ["warmstart", "--env", "rg:basic_arithmetic", "--env-arg", "size=30"]
    assert main([*ws, "--out", str(tmp_path / "ws")]) == 2
    assert "has no demonstration() for a warm start" in _error_line(capsys)
    trainer = ["trainer", "--store", str(tmp_path / "store"), "--env-arg", "x=[1, null]"]
    assert main(trainer) == 2
    assert "x[1]: null" in _error_line(capsys)
