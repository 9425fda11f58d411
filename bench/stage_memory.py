"""Each stage-worker's peak resident memory against what it must hold.

    .venv/bin/python bench/stage_memory.py [--model smollm2-135m] [--stages 2]

Starts a trainer (the smoke env on the model, a step too large for what
the workers make here, so it publishes v0 and waits), a pipeline group of
`colonnade worker --stage K/N` processes and one whole-model `colonnade
worker`, all over one local store. Once the group's front and the whole
worker have each uploaded `--batches` batches, it reads every worker's peak
resident set (VmHWM) and stops them all. Beside each peak:

- `weights_mb`: the worker's int8 tensors as v0's anchor publishes them
  (a stage's own: `engine.stages.stage_names`; a tied matrix counted on
  both the first and the last stage, which each hold it);
- `kv_mb`: the KV cache of its layers at the batch's largest shape (rows x
  the episode's columns, keys and values in float32, the cache's dtype);
- `kv_alloc_mb`: the same cache as the engine allocates it (its buffers
  keep `ROOM` spare columns past the prompt: `engine.torch_backend`);
- `packed_mb`: the bf16 form of the linears' codes the kernels pack (2
  bytes a code, where the planner chose a bf16 kernel: on this project's
  machine, every linear at 4 rows or more);
- `base_mb`: a process's fixed cost, the same interpreter with torch,
  transformers and the worker imported (measured the same way);
- `overhead_mb`: what is left, peak - weights - packed - kv_alloc - base:
  activations, messages, and what the allocator keeps of what was freed
  (`MALLOC_MMAP_THRESHOLD_`, passed on to the workers, changes that: the
  `malloc` field);
- `loaded_peak_mb`: the peak as the worker said it had loaded its weights,
  before its first batch.

Prints one JSON row a worker. Linux only (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

IMPORTS = (
    "import torch, transformers, colonnade.cli.main, colonnade.rollout.stageworker; "
    "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))"
)


def _peak_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for {pid}")


def _spawn(args: list[str], log: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "colonnade.cli.main", *args],
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)  # fmt: skip


def _longest_prompt(path: str) -> int:
    """Tokens of the smoke env's longest training prompt for this model."""
    from colonnade.envs import load_environment
    from colonnade.model import load_tokenizer
    from colonnade.rollout.episodes import task_prompt

    env, tok = load_environment("smoke"), load_tokenizer(path)
    return max(len(task_prompt(tok, env, t)) for t in env.tasks("train"))


def _bytes_of(path: Path, mine) -> float:
    """MB of the tensors `mine` names in a safetensors file, as stored."""
    from safetensors import safe_open

    total = 0
    with safe_open(path, framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (a safetensors handle)
            if mine(name):
                total += f.get_tensor(name).nbytes
    return total / 2**20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-batch", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=64, help="model tokens an episode")
    p.add_argument("--batches", type=int, default=2, help="batches each worker uploads first")
    args = p.parse_args()

    import torch
    from transformers import AutoConfig

    from colonnade.engine.stages import plan_stages, stage_names, stage_skeleton
    from colonnade.engine.torch_backend import ROOM
    from colonnade.model import resolve_model
    from colonnade.model.loading import skeleton
    from colonnade.protocol import keys
    from colonnade.protocol.reader import open_run
    from colonnade.store import LocalStore

    n = args.stages
    ids = [f"s{k + 1}" for k in range(n)]
    rows = args.group_size * args.groups_per_batch
    with tempfile.TemporaryDirectory(prefix="colonnade-stage-memory-") as tmp:
        tmp = Path(tmp)
        root = tmp / "run"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        base = float(subprocess.run([sys.executable, "-c", IMPORTS], env=env, check=True,
                                    capture_output=True, text=True).stdout) / 1024  # fmt: skip
        # groups_per_step far above what the workers make: the trainer never steps.
        trainer = _spawn(["trainer", "--store", str(root), "--preset", "smoke", "--model",
                          args.model, "--group-size", str(args.group_size), "--groups-per-batch",
                          str(args.groups_per_batch), "--groups-per-step", "4096",
                          "--max-turn-tokens", str(args.max_tokens), "--max-episode-tokens",
                          str(args.max_tokens)], tmp / "trainer.log", env)  # fmt: skip
        procs: dict[str, subprocess.Popen] = {}
        try:
            store = LocalStore(root)
            while not store.exists(keys.RUN):
                if trainer.poll() is not None:
                    raise SystemExit((tmp / "trainer.log").read_text()[-3000:])
                time.sleep(0.5)
            group = ",".join(ids)
            for k, w in enumerate(ids):
                procs[w] = _spawn(["worker", "--store", str(root), "--id", w, "--stage",
                                   f"{k + 1}/{n}", "--stage-group", group],
                                  tmp / f"{w}.log", env)  # fmt: skip
            procs["whole"] = _spawn(["worker", "--store", str(root), "--id", "whole"],
                                    tmp / "whole.log", env)  # fmt: skip
            inbox = open_run(store).inbox
            t0 = time.monotonic()
            # The peak as each worker says it has loaded its weights, before its
            # first batch (a front's prefill starts within milliseconds: looked
            # at every 20 ms, that peak may hold the start of one).
            loaded: dict[str, float] = {}
            while len(loaded) < len(procs) and time.monotonic() - t0 < 900:
                for w, proc in procs.items():
                    said = (tmp / f"{w}.log").read_text()
                    if w not in loaded and ("now running v" in said or "stage ready" in said):
                        loaded[w] = _peak_mb(proc.pid)
                time.sleep(0.02)
            while True:
                made = {w: sum(keys.parse_rollout_key(k) is not None
                               for k in inbox.list(keys.worker_dir(w)))
                        for w in (ids[0], "whole")}  # fmt: skip
                if min(made.values()) >= args.batches:
                    break
                for w, proc in procs.items():
                    if proc.poll() is not None:
                        raise SystemExit(f"{w}: " + (tmp / f"{w}.log").read_text()[-3000:])
                if time.monotonic() - t0 > 1800:
                    raise SystemExit(f"no {args.batches} batches in 30 minutes: {made}")
                time.sleep(1.0)
            peaks = {w: _peak_mb(proc.pid) for w, proc in procs.items()}
        finally:
            for proc in (*procs.values(), trainer):
                proc.kill()
                proc.wait()
        anchor = root / keys.full_key(0)
        path = resolve_model(args.model, None)
        config = AutoConfig.from_pretrained(path)
        text = config.get_text_config()
        plan = plan_stages(skeleton(path), n)
        kv_heads = getattr(text, "num_key_value_heads", text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        columns = args.max_tokens + _longest_prompt(path)

        prompt = _longest_prompt(path)

        def kv(layers: int, width: int = columns) -> float:
            return layers * 2 * kv_heads * head_dim * 4 * rows * width / 2**20

        def packed(model) -> float:
            return 2 * sum(m.weight.numel() for m in model.modules()
                           if isinstance(m, torch.nn.Linear)) / 2**20  # fmt: skip

        # The cache's buffer: the prompt and ROOM, grown by half (at least
        # ROOM) each time it fills (`engine.torch_backend.growing_layer`).
        alloc = prompt + ROOM
        while alloc < columns:
            alloc += max(alloc // 2, ROOM)

        out = []
        for k, w in enumerate(ids):
            model, aliases = stage_skeleton(config, plan[k])
            names = stage_names(model, aliases, plan[k])
            out.append({"worker": w, "stage": f"{k + 1}/{n}",
                        "layers": [plan[k].start, plan[k].stop],
                        "weights_mb": _bytes_of(anchor, lambda x, s=names: s.local(x) is not None),
                        "kv_mb": kv(plan[k].layers), "kv_alloc_mb": kv(plan[k].layers, alloc),
                        "packed_mb": packed(model)})  # fmt: skip
        out.append({"worker": "whole", "stage": "-", "layers": [0, text.num_hidden_layers],
                    "weights_mb": _bytes_of(anchor, lambda x: True),
                    "kv_mb": kv(text.num_hidden_layers),
                    "kv_alloc_mb": kv(text.num_hidden_layers, alloc),
                    "packed_mb": packed(skeleton(path))})  # fmt: skip
        for row in out:
            row["peak_mb"] = peaks[row["worker"]]
            row["loaded_peak_mb"] = loaded.get(row["worker"], float("nan"))
            row["base_mb"] = base
            held = row["weights_mb"] + row["packed_mb"] + row["kv_alloc_mb"] + base
            row["overhead_mb"] = row["peak_mb"] - held
            row.update({k: round(v, 1) for k, v in row.items() if isinstance(v, float)})
            row.update(model=args.model, rows=rows, columns=columns, kv_columns=alloc,
                       malloc=os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"))  # fmt: skip
            print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
