"""`colonnade bench trainer --quick`: every case runs in its own process, and
the 2-rank FSDP2 step matches one rank's on the same batch."""

import json

import pytest

from colonnade.bench.trainer import main

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

KEYS = {"case", "model", "device", "dtype", "grad_ckpt", "ranks", "step_s", "tokens_per_s",
        "peak_mem_mb", "publish_s", "publish_blocked_s", "load_peak_rss_mb",
        "peak_rss_mb", "patch_bytes", "trained_params"}  # fmt: skip


@pytest.mark.timeout(400)
def test_quick_trainer_bench_rows_and_two_ranks_match_one(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path))
    assert main(["--quick", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    cases = [(r["dtype"], r["grad_ckpt"], r["ranks"], r["fsdp"]) for r in rows]
    assert cases == [
        ("fp32", False, 1, False),
        ("bf16", False, 1, False),
        ("bf16", True, 1, False),
        ("bf16", True, 1, True),
        ("fp32", False, 2, True),
        ("fp32", False, 2, True),
        ("bf16", True, 1, False),
        ("fp32", False, 2, True),
    ]
    names = [r["case"] for r in rows]
    assert names[-4:] == [
        "fsdp2x2",
        "fsdp2x2+meta-init",
        "bf16+ckpt+lora",
        "fsdp2x2+meta-init+lora",
    ]
    lora, two_lora = rows[-2], rows[-1]
    assert set(lora) >= KEYS and set(two_lora) >= KEYS
    rows = rows[:-2]
    for r in rows:
        assert set(r) >= KEYS and r["model"] == "tiny" and r["device"] == "cpu"
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["publish_s"] > 0
        assert r["peak_mem_mb"] > 0 and r["publish_blocked_s"] >= 0
    one, two, meta = rows[0], rows[-2], rows[-1]
    assert two["tokens"] == one["tokens"] > 0
    assert two["loss_rel_diff"] <= 1e-3 and two["grad_norm_rel_diff"] <= 1e-3
    # Each rank reading its own rows trains the same model.
    assert meta["loss"] == two["loss"] and meta["grad_norm"] == two["grad_norm"]
    assert 0 < meta["load_peak_rss_mb"] <= meta["peak_rss_mb"]
    # LoRA trains the adapters alone, the same on 2 ranks from a skeleton as on one.
    assert 0 < lora["trained_params"] == two_lora["trained_params"] < one["trained_params"] / 4
    assert lora["tokens"] == one["tokens"] and lora["patch_bytes"] > 0
    # bf16 computes differently from fp32, but on the same batch it is close.
    assert abs(rows[1]["loss"] - one["loss"]) <= 0.05 * abs(one["loss"]) + 1e-3
