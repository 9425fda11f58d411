"""Which engine a worker runs: --engine auto | torch | mlx, and MLX missing."""

import pytest

from colonnade.cli.main import main
from colonnade.rollout import loader
from colonnade.rollout.mlx_engine import MlxUnavailable

MISSING = "the MLX engine needs the mlx package (No module named 'mlx')"


def test_auto_is_torch_off_apple_silicon_and_mlx_on_it(monkeypatch):
    monkeypatch.setattr(loader, "mlx_missing", lambda: None)
    monkeypatch.setattr(loader, "apple_silicon", lambda: False)
    assert loader.resolve_engine("auto") == "torch"
    assert loader.resolve_engine("mlx") == "mlx"
    monkeypatch.setattr(loader, "apple_silicon", lambda: True)
    assert loader.resolve_engine("auto") == "mlx"
    assert loader.resolve_engine("torch") == "torch"
    with pytest.raises(ValueError, match="unknown engine"):
        loader.resolve_engine("jax")


def test_without_mlx_auto_falls_back_and_mlx_is_refused(monkeypatch, caplog):
    monkeypatch.setattr(loader, "mlx_missing", lambda: MISSING)
    monkeypatch.setattr(loader, "apple_silicon", lambda: True)
    assert loader.resolve_engine("auto") == "torch"
    assert "using the torch engine" in caplog.text
    with pytest.raises(MlxUnavailable, match="needs the mlx package"):
        loader.resolve_engine("mlx")


def test_worker_cli_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(loader, "mlx_missing", lambda: MISSING)
    code = main(["worker", "--store", str(tmp_path), "--engine", "mlx"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "mlx" in err[0] and err[0].startswith("error:")
