import json

import pytest

from colonnade.cli.main import main

pytestmark = pytest.mark.slow  # a short smoke run: a few versions trained

KEYS = {"honest_rows", "false_positives", "bytes_per_token", "overhead_fraction", "forgers"}
FORGERS = {"swap", "swap-forged", "hot", "stale", "relabel"}


def test_quick_verify_bench_prints_one_json_document(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    args = ["--rows", "48", "--versions", "3", "--no-warmstart", "--no-mlx", "--json"]
    assert main(["bench", "verify", *args]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= KEYS
    assert out["honest_rows"] >= 48 and out["false_positives"] == 0
    assert 0 < out["bytes_per_token"] <= 4.5  # float32 `below`, compressed with the rest
    assert out["overhead_fraction"] >= 0
    assert set(out["honest_gaps"]) == {"torch"}
    by_name = {f["name"]: f for f in out["forgers"]}
    assert set(by_name) == FORGERS
    for f in out["forgers"]:
        assert set(f) >= {"name", "detection_rate", "batches_to_detection"}
    # A truthful swap never passes the free check; a relabelled batch's draws
    # all fall in its moved intervals, but its episodes were trained already:
    # the replay check refuses every one.
    swap = by_name["swap"]
    assert swap["batches"] == 0 or swap["detection_rate"] == 1.0
    relabel = by_name["relabel"]
    assert relabel["free_check_rate"] == 0.0 and relabel["batches"] >= 1
    assert relabel["detection_rate"] == 1.0 and relabel["batches_to_detection"] == 1.0
