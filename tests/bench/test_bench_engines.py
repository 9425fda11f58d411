"""`colonnade bench engines --json`: one row per (architecture, engine)."""

import json

from colonnade.cli.main import main

KEYS = {"arch", "engine", "ok", "logp_max_abs_diff", "logp_mean_abs_diff", "tok_s"}


def test_no_mlx_gives_torch_rows_only(capsys):
    code = main(["bench", "engines", "--json", "--no-mlx", "--archs", "llama,qwen3_moe",
                 "--rows", "2", "--tokens", "4"])  # fmt: skip
    rows = json.loads(capsys.readouterr().out)
    assert code == 0 and [(r["arch"], r["engine"]) for r in rows] == [
        ("llama", "torch"),
        ("qwen3_moe", "torch"),
    ]
    assert all(set(r) == KEYS and r["ok"] for r in rows)


def test_mlx_rows_are_ok_and_within_the_target(mlx_ready, capsys):
    code = main(["bench", "engines", "--json", "--archs", "qwen2,gemma3_text",
                 "--rows", "2", "--tokens", "8"])  # fmt: skip
    rows = [r for r in json.loads(capsys.readouterr().out) if r["engine"] == "mlx"]
    assert code == 0 and len(rows) == 2
    assert all(set(r) == KEYS and r["ok"] and r["logp_mean_abs_diff"] <= 0.05 for r in rows)
