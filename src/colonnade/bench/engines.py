"""Engines by architecture: does each engine run it, and how far apart are they.

`colonnade bench engines` builds one tiny random-init model per architecture
from a transformers config (`tiny_model`; nothing is downloaded), publishes
its weights as the trainer would (`pulse.prepare(…, "int8")`) and runs the
same codes in the torch int8 engine and, where installed, the MLX engine
(mlx-lm). One row per (architecture, engine): whether the engine ran, the
generated tokens/s, and how far the log-probs it recorded are from the
torch int8 engine's teacher-forced log-probs of the same tokens: the
cross-engine mismatch the trainer's DPPO gate absorbs. The torch row is the
same comparison against itself (batched, cached generation against one
full pass). The tests build their models here too (tests/rollout/test_mlx_archs.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import torch

ARCHS = ("llama", "qwen2", "qwen3", "gemma3_text", "phi3", "qwen3_moe")
TEXTS = [
    f"<search>gene GX{i} protein</search> <information>GX{i} binds to PRT{i * 7 % 97} "
    f"in the liver.</information> <answer>PRT{i * 7 % 97}</answer> the quick brown fox"
    for i in range(200)
]
PROMPTS = ["<search>gene GX3", "the quick brown fox", "<answer>", "GX41 binds to PRT"]
REPLY = " <information>GX3 binds to PRT21 in the liver.</information> "
# Targets: every MLX row runs, mean gap at most this many nats.
MEAN_GAP_TARGET = 0.05


def tiny_tokenizer(vocab_size: int = 300):
    """A byte-level BPE tokenizer of about `vocab_size` tokens (trained here, no download)."""
    from colonnade.model.tokenizer import train_bpe_tokenizer

    return train_bpe_tokenizer(TEXTS, vocab_size, min_frequency=2)


def _config(arch: str, tok):
    import transformers as tf

    common = {
        "vocab_size": len(tok),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": None,
        # Wider than transformers' 0.02: random logits far from uniform, so
        # the log-probs compared are not all near log(1/V).
        "initializer_range": 0.1,
    }
    builders: dict[str, Callable] = {
        "llama": lambda: tf.LlamaConfig(**common, tie_word_embeddings=True),
        "qwen2": lambda: tf.Qwen2Config(**common),
        "qwen3": lambda: tf.Qwen3Config(**common, head_dim=16),
        # One sliding layer with a short window: episodes outgrow it.
        "gemma3_text": lambda: tf.Gemma3TextConfig(
            **common,
            head_dim=16,
            sliding_window=24,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "phi3": lambda: tf.Phi3Config(**common),
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **common,
            head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        ),
    }
    if arch not in builders:
        raise ValueError(f"unknown architecture {arch!r}; choose from {', '.join(ARCHS)}")
    return builders[arch]()


def tiny_model(arch: str, tok, seed: int = 0):
    """A float32 random-init transformers model of `arch` (hidden 64, 2 layers)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(_config(arch, tok), dtype=torch.float32)
    return model.eval()


def replies(n_turns: int):
    """A responder that answers `n_turns - 1` turns with REPLY, then ends the episode."""
    seen: list[str] = []

    def respond(text: str) -> str | None:
        seen.append(text)
        return None if len(seen) >= n_turns else REPLY

    return respond


def engines_for(arch: str, tok, mlx: bool, seed: int = 0) -> dict:
    """{"torch": torch int8 engine, "mlx": MLX int8 engine} over one set of published codes."""
    from colonnade.engine import engine_for
    from colonnade.model import int8_state

    model = tiny_model(arch, tok, seed)
    state = int8_state(model)
    cpu = torch.device("cpu")
    # MLX first: the torch engine swaps int8 linears into `model` itself.
    engines = {"mlx": engine_for(model, tok, state, "int8", cpu, "mlx")} if mlx else {}
    engines["torch"] = engine_for(model, tok, state, "int8", cpu, "torch")
    return engines


def gaps(episodes, reference) -> torch.Tensor:
    """|recorded − teacher-forced| log-prob of every model token, in `reference` (torch)."""
    from colonnade.model import sequence_logprobs

    out = []
    for ep in episodes:
        with torch.no_grad():
            ref = sequence_logprobs(reference, ep.prompt_ids + ep.tokens, len(ep.prompt_ids))
        mine = torch.tensor(ep.from_model)
        out.append((ref[mine] - torch.tensor(ep.logprobs)[mine]).abs())
    return torch.cat(out)


def measure(arch: str, name: str, engine, reference, tok, rows: int, tokens: int) -> dict:
    """One row: `engine` runs `rows` two-turn episodes; its log-probs against `reference`."""
    from colonnade.engine import SamplingParams

    prompts = [tok.encode(PROMPTS[i % len(PROMPTS)], add_special_tokens=False) for i in range(rows)]
    params = SamplingParams(max_turn_tokens=tokens, max_episode_tokens=4 * tokens, ignore_eos=True)
    row = {"arch": arch, "engine": name, "ok": False}
    try:
        # Untimed first call at the same batch shapes: the torch int8 kernels
        # are measured and chosen per row count (`model.kernels`) here.
        engine.generate(prompts, [replies(2) for _ in prompts], replace(params, max_turn_tokens=3))
        t0 = time.perf_counter()
        eps = engine.generate(prompts, [replies(2) for _ in prompts], params, seed=0)
        seconds = time.perf_counter() - t0
        diff = gaps(eps, reference)
    except Exception as e:  # a row that fails says why and the others still run
        return {**row, "error": f"{type(e).__name__}: {e}"}
    generated = sum(sum(ep.from_model) for ep in eps)
    return {
        **row,
        "ok": bool(torch.isfinite(diff).all()),
        "logp_max_abs_diff": round(float(diff.max()), 5),
        "logp_mean_abs_diff": round(float(diff.mean()), 5),
        "tok_s": round(generated / seconds, 1),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--archs", default=",".join(ARCHS), help="comma list (default: %(default)s)")
    p.add_argument("--rows", type=int, default=8, help="episodes per engine (default 8)")
    p.add_argument("--tokens", type=int, default=24, help="tokens per turn (default 24)")
    p.add_argument("--json", action="store_true", help="print result rows as JSON on stdout")
    p.add_argument("--no-mlx", action="store_true", help="leave out the MLX rows")


def run(args: argparse.Namespace) -> int:
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    bad = [a for a in archs if a not in ARCHS]
    if bad or args.rows < 1 or args.tokens < 1:
        raise SystemExit(f"error: archs must be among {', '.join(ARCHS)}; rows, tokens >= 1")
    mlx = not args.no_mlx and _mlx_or_say()
    tok = tiny_tokenizer()
    rows = []
    for arch in archs:
        _log(f"{arch}: torch int8{' and MLX int8' if mlx else ''}, {args.rows} episodes")
        engines = engines_for(arch, tok, mlx)
        reference = engines["torch"].backend.model
        for name, engine in engines.items():
            rows.append(measure(arch, name, engine, reference, tok, args.rows, args.tokens))
    print(json.dumps(rows, indent=2) if args.json else markdown_table(rows))
    return 0


def markdown_table(rows: list[dict]) -> str:
    head = "| arch | engine | ok | log-prob gap max | gap mean | tok/s |\n|---|---|---|---|---|---|"
    body = [
        f"| {r['arch']} | {r['engine']} | {'yes' if r['ok'] else 'no: ' + r.get('error', '')} "
        f"| {r.get('logp_max_abs_diff', '')} | {r.get('logp_mean_abs_diff', '')} "
        f"| {r.get('tok_s', '')} |"
        for r in rows
    ]
    return "\n".join([head, *body])


def _mlx_or_say() -> bool:
    from colonnade.engine.mlx_backend import mlx_missing

    reason = mlx_missing()
    if reason:
        _log(f"no MLX rows: {reason}")
    return reason is None


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
