"""The PULSE benchmark runs end to end on a small model and reports what it measured."""

import json

import numpy as np
import pytest
import torch

from colonnade.bench import pulse as bench

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane


def test_quick_run_writes_complete_results(tmp_path, capsys):
    out = tmp_path / "pulse.json"
    md = tmp_path / "pulse.md"
    assert bench.main(["--quick", "--json", str(out), "--markdown", str(md)]) == 0
    data = json.loads(out.read_text())
    (row,) = data["results"]
    for key in (
        "density",
        "full_bytes",
        "trl",
        "trl_zstd",
        "grail",
        "ours",
        "bound_bytes",
        "encode_s",
        "apply_s",
        "full_write_s",
        "full_read_s",
        "int8_ours",
        "ours_over_trl",
        "ours_over_bound",
        "time_ratio",
        "peak_mem_over_bf16",
    ):
        assert key in row, key
    assert row["model"] == "llama" and set(data["info"]) == {"llama"}
    assert 0 < row["density"] <= 1 and row["bound_bytes"] > 0
    assert row["trl"] > row["ours"] > 0 and row["full_bytes"] > row["trl"]
    assert row["encode_s"] > 0 and row["full_write_s"] > 0
    for key in (
        "encode_gbps",
        "apply_gbps",
        "apply_inplace_gbps",
        "encode_hash_share",
        "apply_hash_share",
        "read_gbps",
        "blake3_gbps",
        "limit_gbps",
    ):
        assert row[key] > 0, key  # present and positive; no timing claims
    assert len(data["targets"]) == len(bench.TARGETS)
    assert any(t.startswith("n/a") and "GB/s" in t for t in data["targets"])  # no SmolLM2 row
    assert "| lr |" in md.read_text() and "enc GB/s" in md.read_text()
    assert "PULSE benchmark" in capsys.readouterr().out


def test_peer_sizes_match_hand_counts():
    old = {"w": torch.zeros(100, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][[3, 50]] = 1.0
    sizes = bench.peer_sizes(old, new)
    assert sizes["trl"] > 2 * (4 + 2)  # two int32 indices, two bf16 values, plus a header
    assert sizes["grail"] > 0


def test_entropy_bound_by_hand():
    old = {"w": torch.zeros(8, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][[0, 1]] = 1.0  # 2 of 8 changed, identical XOR residuals
    bits, changed, total = bench.entropy_bound_bits(old, new)
    h = -(0.25 * np.log2(0.25) + 0.75 * np.log2(0.75))
    assert (changed, total) == (2, 8)
    assert abs(bits - 8 * h) < 1e-9  # residual planes are constant: 0 bits


def test_publish_stores_a_tied_tensor_once():
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight  # tied, as SmolLM2's head is
    state = bench.publish(torch.nn.ModuleDict({"emb": emb, "head": head}))
    assert list(state) == ["emb.weight"]
    assert state["emb.weight"].dtype == torch.bfloat16
