"""`colonnade plan`: the sizes to provision before a run (operate/plan.py)."""

from __future__ import annotations

import argparse
import json

from colonnade.config import TrainerConfig
from colonnade.config.presets import TRAINER_PRESETS


def register(sub: argparse._SubParsersAction) -> None:
    searchqa = TRAINER_PRESETS["searchqa"]
    p = sub.add_parser(
        "plan",
        help="sizes to provision before a run: memory per rank, checkpoint, staging, timeouts",
        description="Size a run from its model's shape (instantiated on the meta device: "
        "nothing is downloaded or allocated): trainer memory per rank, the publication's peak "
        "on rank 0, the checkpoint and staging folders, a worker's int8 state, memory and "
        "decode bound, and the claim lease and timeouts that follow. Each line names what "
        'it rests on; docs/operating.md, "Sizing a run", explains them.',
    )
    p.add_argument(
        "--model",
        required=True,
        help="a preset (tiny, smollm2-135m), a built-in shape (qwen3-0.6b, qwen3-1.7b, "
        "qwen3-8b) or a model folder with a config.json",
    )
    p.add_argument(
        "--lora-rank",
        type=int,
        default=0,
        metavar="R",
        help="size LoRA at rank R on the q/k/v/o/gate/up/down projections (default: full "
        "fine-tuning)",
    )
    p.add_argument("--ranks", type=int, default=1, metavar="N", help="trainer ranks (GPUs)")
    p.add_argument(
        "--fsdp",
        action="store_true",
        help="FSDP2 on one rank too (the trainer's --fsdp): a layer's bf16 copy at a time",
    )
    p.add_argument(
        "--bandwidth-gbs",
        type=float,
        metavar="GBS",
        help="a worker's memory bandwidth in GB/s (default: a laptop's or a base Apple "
        "M-series chip's, operate/plan.py DEFAULT_BANDWIDTH_GBS)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        metavar="G",
        default=searchqa["group_size"],
        help="episodes per group (default: the searchqa preset's)",
    )
    p.add_argument(
        "--groups-per-batch",
        type=int,
        metavar="B",
        default=searchqa["groups_per_batch"],
        help="groups per worker upload (default: the searchqa preset's)",
    )
    p.add_argument(
        "--max-episode-tokens",
        type=int,
        metavar="T",
        default=searchqa["max_episode_tokens"],
        help="tokens of an episode after its prompt (default: the searchqa preset's)",
    )
    p.add_argument(
        "--logit-chunk-tokens",
        type=int,
        metavar="N",
        default=TrainerConfig.logit_chunk_tokens,
        help="row-positions whose fp32 logits exist at once (default: the trainer's)",
    )
    p.add_argument("--json", action="store_true", help="one JSON document")
    p.set_defaults(handler=_plan)


def _plan(args: argparse.Namespace) -> int:
    from colonnade.model.shapes import model_config
    from colonnade.operate import plan

    from .main import CliError

    try:
        setting = plan.Setting(
            ranks=args.ranks,
            fsdp=args.fsdp,
            lora_rank=args.lora_rank,
            bandwidth_gbs=(
                plan.DEFAULT_BANDWIDTH_GBS if args.bandwidth_gbs is None else args.bandwidth_gbs
            ),
            group_size=args.group_size,
            groups_per_batch=args.groups_per_batch,
            max_episode_tokens=args.max_episode_tokens,
            logit_chunk_tokens=args.logit_chunk_tokens,
        )
        setting.check()
        config, source = model_config(args.model)
    except (ValueError, OSError) as e:
        raise CliError(str(e).splitlines()[0]) from None
    counts = plan.count(config)
    sections = plan.plan(counts, setting)
    facts = plan.model_facts(counts, setting, source)
    if args.json:
        print(json.dumps(plan.as_json(facts, sections, setting), indent=2))
    else:
        print(plan.render(facts, sections))
    return 0
