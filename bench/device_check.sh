#!/usr/bin/env bash
# The trainer's GPU checks, in one script for a CUDA machine (run from the repo root):
#
#   bash bench/device_check.sh            # figures land in $OUT (default bench/out/device)
#
# 1. `colonnade bench trainer --device cuda`: SmolLM2-135M (when its package is
#    installed, else skipped with a note) and the tiny model, fp32 against bf16
#    against bf16 + activation checkpointing on 1 GPU: step seconds, tokens/s,
#    peak GPU memory (max_memory_allocated), background publish seconds.
#    1b: a Qwen3-1.7B-shaped model (random init) in bf16 + checkpointing under
#    FSDP2 on one GPU, without and with CPU offload, and with rank-16 LoRA on its
#    frozen bf16 base: step time, peak GPU memory, bytes per version.
# 2. A short `colonnade run --preset smoke` with the trainer on CUDA in bf16 and one
#    CPU worker: step time, peak GPU memory and held-out pass@1 before and after.
#
# On a machine without internet (the lent GPU machine), the Python packages that
# its image lacks travel as wheels in .whl/ (fetch them here first with
# `bash bench/device_wheels.sh`); they are installed into /tmp/site.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/out/device}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export COLONNADE_CACHE=${COLONNADE_CACHE:-/tmp/colonnade-cache}
PY=${PYTHON:-python3}
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
$PY - <<'EOF'
import torch
assert torch.cuda.is_available(), "no CUDA device: this script is for a GPU machine"
print("torch", torch.__version__, "on", torch.cuda.get_device_name(0), flush=True)
EOF
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

echo "== 1. bench trainer on CUDA"
$PY -m colonnade bench trainer --device cuda --models smollm2-135m,tiny \
    --cases fp32,bf16,bf16+ckpt --steps 4 --groups 8 --group-size 8 --prompt 256 --gen 512 \
    --micro-tokens 16384 --json | tee "$OUT/bench_trainer.jsonl"

echo "== 1b. bench trainer on CUDA at size: a Qwen3-1.7B shape (random init), FSDP2 on 1 GPU"
$PY -m colonnade bench trainer --device cuda --models qwen3-1.7b \
    --cases fsdp1+bf16+ckpt,fsdp1+bf16+ckpt+offload,bf16+ckpt+lora --steps 3 --groups 4 \
    --group-size 8 \
    --prompt 256 --gen 512 \
    --micro-tokens 16384 --json | tee "$OUT/bench_trainer_1p7b.jsonl"

echo "== 2. colonnade run: trainer on CUDA (bf16), one CPU worker"
cat > "$OUT/run.toml" <<'EOF'
eval_n = 100
[trainer]
max_versions = 30
dtype = "bf16"
[worker]
device = "cpu"
EOF
rm -rf "$OUT/run"
$PY -m colonnade run --preset smoke --config "$OUT/run.toml" --device cuda --workers 1 \
    --threads 4 --out "$OUT/run" --no-live 2>&1 | tail -n 20 | tee "$OUT/run_tail.txt"
$PY - "$OUT/run" <<'EOF' | tee "$OUT/run_summary.json"
import json, statistics, sys
from pathlib import Path
run = Path(sys.argv[1])
report = json.loads((run / "report.json").read_text())
rows = [json.loads(line) for seg in sorted((run / "store/metrics/trainer-main").glob("*.jsonl"))
        for line in seg.read_text().splitlines()]
log = (run / "logs/trainer.log").read_text()
print(json.dumps({
    "status": report["status"],
    "pass_at_1_before": report["eval"]["before"]["pass_at_1"],
    "pass_at_1_after": report["eval"]["after"]["pass_at_1"],
    "step_seconds_median": statistics.median(r["step_seconds"] for r in rows),
    "train_seconds_median": statistics.median(r["step_seconds"] - r["wait_seconds"] for r in rows),
    "publish_blocked_median": statistics.median(r["publish_blocked_seconds"] for r in rows),
    "peak_gpu_mb": max(r.get("peak_mem_mb", 0) for r in rows),
    "device_line": next((l for l in log.splitlines() if "trainer on" in l), ""),
}, indent=1))
EOF
