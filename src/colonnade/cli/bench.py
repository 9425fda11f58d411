"""`colonnade bench …`: the benchmarks, printed side by side in one run."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run a benchmark", description="Run a benchmark.")
    bsub = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    from colonnade.bench import pulse as bench_pulse

    bp = bsub.add_parser(
        "pulse",
        help="PULSE patches against full checkpoints and peers' sparse formats",
        description="Train a real transformers LM for a few AdamW steps, publish bf16 "
        "after each, and compare patch sizes and times against full safetensors, "
        "TRL-style and grail-style patches and the order-0 entropy bound.",
    )
    bench_pulse.add_arguments(bp)
    bp.set_defaults(handler=bench_pulse.run)
    from colonnade.bench import rollout as bench_rollout

    br = bsub.add_parser(
        "rollout",
        help="tokens/s of the engine in fp32 and int8 against transformers' generate",
        description="Generated tokens/s of colonnade's engine (fp32 and PULSE int8) and of "
        "transformers' generate at the same batch sizes, side by side, with peak RSS.",
    )
    bench_rollout.add_arguments(br)
    br.set_defaults(handler=bench_rollout.run)
    from colonnade.bench import e2e as bench_e2e

    be = bsub.add_parser(
        "e2e",
        help="async (max_lag 2) against sync (max_lag 0) training, 1 and 2 workers",
        description="Full smoke runs side by side: wall time to a fixed training pass "
        "rate with max_lag 2 against max_lag 0, the trainer's wait fraction, and "
        "episodes/s with 1 and 2 workers.",
    )
    bench_e2e.add_arguments(be)
    be.set_defaults(handler=bench_e2e.run)
