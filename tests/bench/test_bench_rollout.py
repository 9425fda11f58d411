import json

import pytest

from colonnade.bench.rollout import main

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

KEYS = {"model", "batch", "fp32_tok_s", "int8_tok_s", "hf_generate_tok_s", "peak_rss_mb"}


def test_quick_rollout_bench_prints_json_rows(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    assert main(["--quick", "--repeats", "1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["model"], r["batch"]) for r in rows] == [("tiny", 1), ("tiny", 8)]
    for r in rows:
        assert set(r) >= KEYS
        assert r["fp32_tok_s"] > 0 and r["int8_tok_s"] > 0 and r["hf_generate_tok_s"] > 0
        assert r["peak_rss_mb"] > 0
