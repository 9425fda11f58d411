import json

import pytest
import torch

from colonnade.bench.rollout import main, weight_bytes
from colonnade.model.kernels import KERNELS, STACKING

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

KEYS = {
    "model", "batch", "compiled", "cpu", "fp32_tok_s", "int8_tok_s", "hf_generate_tok_s",
    "bandwidth_fraction", "peak_rss_mb",
}  # fmt: skip
EAGER_KEYS = KEYS | {"int8_apart_tok_s", "fused_over_apart"}
COMPILED_KEYS = KEYS | {"compile_s", "compiled_over_eager"}


def test_quick_rollout_bench_prints_json_rows(tmp_path, monkeypatch, capsys, tiny_dir):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    # The groups rows of another model and env (e.g. a warm start that
    # searches, on multi-hop searchqa2; here: smoke, for speed), measured once
    # and labelled with the model they ran.
    groups_of = ["--groups-model", str(tiny_dir), "--groups-env", "smoke", "--group-size", "2"]
    tools = ["--tool-latency-ms", "0", "20", "--tool-tail-ms", "200", "--tool-tail-share", "0.5"]
    assert main(["--quick", "--repeats", "1", "--json", *groups_of, *tools]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = [r for r in out if "kind" not in r]
    # Tools rows: each latency, the batch waiting and the rows parked.
    tool_rows = [r for r in out if r.get("kind") == "tools"]
    assert [(r["tool_latency_ms"], r["async"]) for r in tool_rows] == [
        (0, False), (0, True), (20, False), (20, True)
    ]  # fmt: skip
    assert all(r["episodes_s"] > 0 and r["calls_per_episode"] == 3 for r in tool_rows)
    assert tool_rows[1]["of_fast"] == 1.0 and tool_rows[3]["tool_tail_ms"] == 200
    (machine,) = [r for r in out if r.get("kind") == "machine"]
    (groups,) = [r for r in out if r.get("kind") == "groups"]
    assert groups["model"] == str(tiny_dir) and groups["group_size"] == 2
    assert groups["env"] == "smoke" and groups["tasks"] == 2 and groups["turns_mean"] >= 1
    assert groups["baseline_episodes_s"] > 0 and groups["shared_episodes_s"] > 0
    # Eager and compiled rows side by side, for each batch size.
    assert [(r["model"], r["batch"], r["compiled"]) for r in rows] == [
        ("tiny", 1, False), ("tiny", 1, True), ("tiny", 8, False), ("tiny", 8, True)
    ]  # fmt: skip
    for r in rows:
        assert set(r) >= (COMPILED_KEYS if r["compiled"] else EAGER_KEYS)
        assert r["fp32_tok_s"] > 0 and r["int8_tok_s"] > 0 and r["hf_generate_tok_s"] > 0
        assert r["peak_rss_mb"] > 0 and r["cpu"] == machine["cpu"]
        assert r["int8_bandwidth_fraction"] > 0 and r["fp32_bandwidth_fraction"] > 0
        assert r["bandwidth_fraction"] == r["int8_bandwidth_fraction"]
        if r["compiled"]:
            assert r["compile_s"] > 0 and r["compiled_over_eager"] > 0
        else:
            assert r["int8_apart_tok_s"] > 0 and r["fused_over_apart"] > 0
    # The machine the figures come from, and the kernels this run measured
    # for every int8 linear shape of the tiny model at the rows it ran.
    assert machine["cpu"] and machine["threads"] >= 1 and machine["copy_bandwidth_gb_s"] > 0
    kernels = machine["int8_kernels"]
    assert kernels and set(kernels.values()) <= set(KERNELS) | set(STACKING)
    assert any(slot.endswith("@1") for slot in kernels)


def test_weight_bytes_counts_what_a_step_reads(tiny, tiny_int8):
    # float linears: 4 bytes a weight; int8 ones: a byte a code and a float32 row scale
    model, _ = tiny
    qmodel, _ = tiny_int8
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    n = sum(m.weight.numel() for m in linears)
    rows = sum(m.weight.shape[0] for m in linears)
    assert weight_bytes(model) == 4 * n
    assert weight_bytes(qmodel) == n + 4 * rows
