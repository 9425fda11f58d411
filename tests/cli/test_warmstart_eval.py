"""`colonnade warmstart` builds once and reuses; `colonnade eval --json` reports figures."""

import json

from colonnade.cli.main import main


def test_warmstart_teaches_the_format_and_is_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "ws"
    args = ["warmstart", "--model", "tiny", "--env", "smoke", "--steps", "60", "--drill-steps", "0"]
    args += ["--out", str(out)]
    assert main(args) == 0
    assert "built" in capsys.readouterr().err
    assert (out / "config.json").is_file() and (out / "warmstart.json").is_file()
    assert main(args) == 0
    assert "reused" in capsys.readouterr().err
    assert main(["eval", "--model", str(out), "--env", "smoke", "-n", "60", "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["n"] == 60 and figures["format_ok"] >= 0.9  # the base had 0
    assert set(figures["greedy"]) >= {"pass_at_1", "format_ok", "n"}
    # Another config may not overwrite this directory.
    assert main([*args[:-2], "--out", str(out), "--good-fraction", "0.9"]) == 2
    # The same model on the MLX engine: the same published int8 codes, greedy
    # figures within a few tasks of torch's (they differ only in rounding).
    mlx = ["eval", "--model", str(out), "--env", "smoke", "-n", "60", "--json", "--engine", "mlx"]
    from colonnade.model.mlx_llama import mlx_missing

    if mlx_missing() is None:
        assert main(mlx) == 0
        on_mlx = json.loads(capsys.readouterr().out)
        assert on_mlx["n"] == 60 and on_mlx["format_ok"] >= 0.9
        assert abs(on_mlx["greedy"]["pass_at_1"] - figures["greedy"]["pass_at_1"]) <= 0.1
