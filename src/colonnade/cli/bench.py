"""`colonnade bench …`: the benchmarks, printed side by side in one run."""

from __future__ import annotations

import argparse
import importlib

# name -> (help, description); each lives in colonnade.bench.<name> with
# add_arguments(parser) and run(args).
BENCHES = {
    "pulse": (
        "PULSE patches against full checkpoints and peers' sparse formats",
        "Train a real transformers LM for a few AdamW steps, publish bf16 after each, and "
        "compare patch sizes and times against full safetensors, TRL-style and grail-style "
        "patches and the order-0 entropy bound.",
    ),
    "rollout": (
        "tokens/s of the engines in fp32 and int8 against transformers' generate",
        "Generated tokens/s of colonnade's torch engine (fp32 and PULSE int8; its step eager "
        "and compiled), of MLX's (fp32, bf16, int8; where installed) and of transformers' "
        "generate at the same batch sizes, side by side, with peak RSS.",
    ),
    "trainer": (
        "one RL step in fp32, bf16, bf16 + activation checkpointing and FSDP2 on 2 ranks",
        "The same fixed batch of groups through the trainer's step in each precision and "
        "layout, each in a fresh process: step seconds, tokens/s, peak memory, background "
        "publish seconds and the time a step waited for it; 2 ranks' loss and gradient norm "
        "against 1 rank's.",
    ),
    "engines": (
        "each engine on each architecture: runs or not, log-prob gap to torch int8, tok/s",
        "One tiny random-init model per architecture (llama, qwen2, qwen3, gemma3_text, phi3, "
        "qwen3_moe; built from a transformers config, nothing downloaded), its published int8 "
        "codes run by the torch int8 engine and the MLX engine (mlx-lm): per (architecture, "
        "engine) whether it ran, generated tokens/s, and the max and mean gap between the "
        "log-probs it recorded and the torch int8 engine's teacher-forced ones.",
    ),
    "batches": (
        "rollout batches: protocol 3's binary form against protocol 2's JSON",
        "One realistic batch (8 groups x 8 episodes x 512 tokens, vocab 49152 by default) "
        "encoded and decoded as zstd JSON, as zstd safetensors (the wire format) and as raw "
        "safetensors, side by side: bytes, encode and decode milliseconds (median of repeats).",
    ),
    "e2e": (
        "async (max_lag 2) against sync (max_lag 0) training, 1 and 2 workers",
        "Full smoke runs side by side: wall time to a fixed training pass rate with max_lag "
        "2 against max_lag 0, the trainer's wait fraction, and episodes/s with 1 and 2 "
        "workers.",
    ),
    "signing": (
        "what the trainer's and workers' signatures cost a smoke run",
        "One smoke run timed end to end; every object it signed or checked counted from "
        "what it left, and each kind signed and verified again at its real size (median of "
        "repeats): the total against the run's wall time.",
    ),
    "fleet": (
        "the store protocol with a simulated fleet on a simulated WAN",
        "The real trainer (tiny model, smoke env) and simulated workers that are real protocol "
        "clients (they follow patches, pace or claim work, upload signed batches; generation is "
        "a cheap policy), each behind a store view that counts requests by verb and adds latency "
        "and a per-worker bandwidth; churn replaces workers as versions go. Per version and in "
        "total: requests and bytes per worker, anchor downloads by followers, waste, the "
        "trainer's wait, objects and bytes in the store; a joiner's catch-up; the same run with "
        "--baseline-workers for the wait side by side; dollars per 1,000 versions on R2 and S3.",
    ),
    "verify": (
        "proven sampling: honest rows and forgers through the free check and spot checks",
        "A preset's run in one process (--preset smoke or demo): honest batches from the torch "
        "int8 engine (and MLX where installed) across lags 0..max_lag, each row recomputed on "
        "its version's published codes (false positives), forgers (token swaps, a forged "
        "commitment, T = 1.3, v - 2 named v, episodes already trained relabelled newer) with "
        "each one's "
        "detection rate and batches to detection at the spot rate, the bytes `below` adds a "
        "token, and the spot check's time against the train step's.",
    ),
    "serve": (
        "the OpenAI-compatible endpoint against the engine called directly: episodes/s",
        "The same single-turn chat episodes (searchqa's test prompts) run directly through "
        "the engine (continuous batching, --clients rows) and through `colonnade serve`'s "
        "endpoint by --clients concurrent openai clients in a process of their own, each "
        "episode drawn by the same key on both paths: episodes/s of each side by side "
        "(direct_episodes_s, endpoint_episodes_s), their ratio, and the share of episodes "
        "whose tokens are the same on both.",
    ),
    "pipeline": (
        "a model run by a pipeline of stage-workers against one whole-model worker",
        "The same fixed-length episodes through one whole-model int8 worker and through "
        "groups of stage-workers (the first stage here, each later stage in a process of its "
        "own) over a local store behind the fleet bench's WAN view (--latency-ms a "
        "request): per (stages, latency, micro-batches in flight) the episodes/s measured, "
        "the whole worker's, and the throughput model's prediction; each later stage's "
        "resident memory.",
    ),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name, (help_text, description) in BENCHES.items():
        module = importlib.import_module(f"colonnade.bench.{name}")
        b = bsub.add_parser(name, help=help_text, description=description)
        module.add_arguments(b)
        b.set_defaults(handler=module.run)
