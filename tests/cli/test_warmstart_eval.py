"""`colonnade warmstart` builds once and reuses; `colonnade eval --json` reports figures,
on the torch engine and (where MLX is installed) on the MLX engine."""

import contextlib
import io
import json
from types import SimpleNamespace

import pytest

from colonnade.cli.main import main

# A warm start built from scratch and two evals of 60 tasks: 1.5-2 min on 2 cores.
pytestmark = pytest.mark.slow

N = 60


def _run(args: list[str]) -> SimpleNamespace:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(args)
    return SimpleNamespace(code=code, out=out.getvalue(), err=err.getvalue())


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    """A warm start of `tiny` on smoke (60 steps), built once, and its torch eval."""
    cache = tmp_path_factory.mktemp("cache")
    out = tmp_path_factory.mktemp("ws")
    args = ["warmstart", "--model", "tiny", "--env", "smoke", "--steps", "60", "--drill-steps", "0"]
    args += ["--out", str(out)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLONNADE_CACHE", str(cache))
        first = _run(args)
        assert first.code == 0, first.err[-2000:]
        ev = _run(["eval", "--model", str(out), "--env", "smoke", "-n", str(N), "--json"])
        assert ev.code == 0, ev.err[-2000:]
    return SimpleNamespace(cache=cache, out=out, args=args, built=first.err,
                           figures=json.loads(ev.out))  # fmt: skip


def test_warmstart_teaches_the_format_and_is_cached(warm, monkeypatch):
    monkeypatch.setenv("COLONNADE_CACHE", str(warm.cache))
    assert "built" in warm.built
    assert (warm.out / "config.json").is_file() and (warm.out / "warmstart.json").is_file()
    again = _run(warm.args)
    assert again.code == 0 and "reused" in again.err
    figures = warm.figures
    assert figures["n"] == N and figures["format_ok"] >= 0.9  # the base had 0
    assert set(figures["greedy"]) >= {"pass_at_1", "format_ok", "n"}
    # Another config may not overwrite this directory.
    assert main([*warm.args[:-2], "--out", str(warm.out), "--good-fraction", "0.9"]) == 2


def test_mlx_engine_evaluates_the_warm_start_as_torch_does(warm, mlx_ready, monkeypatch):
    """The same model on the MLX engine: the same published int8 codes, greedy
    figures within a few tasks of torch's (they differ only in rounding).
    Without MLX, `mlx_ready` skips this test and says why (in CI it fails)."""
    monkeypatch.setenv("COLONNADE_CACHE", str(warm.cache))
    mlx = _run(["eval", "--model", str(warm.out), "--env", "smoke", "-n", str(N), "--json",
                "--engine", "mlx"])  # fmt: skip
    assert mlx.code == 0, mlx.err[-2000:]
    on_mlx = json.loads(mlx.out)
    assert on_mlx["n"] == N and on_mlx["format_ok"] >= 0.9
    assert abs(on_mlx["greedy"]["pass_at_1"] - warm.figures["greedy"]["pass_at_1"]) <= 0.1
