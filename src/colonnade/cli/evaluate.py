"""`colonnade eval` and `colonnade warmstart`: a model's figures, and a weak base."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .envargs import add_env_arg, env_kwargs


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser(
        "eval",
        help="pass@1 and the environment's metrics of a model on an environment split",
        description="Evaluate a model on an environment split with the rollout engine "
        "(int8 by default, as workers run it): pass@1 (the environment's declared success; "
        "the output names the rule), sampled at --temperature and greedy, mean reward and "
        "the mean of every metric the environment reports.",
    )
    e.add_argument("--model", required=True, help="model directory, preset or hub name")
    e.add_argument("--env", default="searchqa", help="environment name or import path")
    add_env_arg(e)
    e.add_argument("--split", default="test", choices=["train", "test"])
    e.add_argument("-n", type=int, default=500, help="tasks to run (first n of the split)")
    e.add_argument("--precision", default="int8", choices=["int8", "fp32", "bf16"])
    e.add_argument("--device", default="cpu", help="cpu | cuda | mps | auto (torch engine)")
    e.add_argument(
        "--engine", default="torch", choices=["auto", "torch", "mlx"], help="rollout engine"
    )
    e.add_argument("--temperature", type=float, default=1.0, help="of the sampled pass")
    e.add_argument("--batch-size", type=int, default=50)
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    e.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    e.set_defaults(handler=_eval)
    w = sub.add_parser(
        "warmstart",
        help="supervised warm start on the environment's demonstrations (cached)",
        description="Fine-tune a model on demonstrations: a --good-fraction share of good "
        "trajectories (search, then answer from the information), the rest guesses, so "
        "RL has a weak base that knows the format. Deterministic; a second run with the "
        "same settings reuses the result.",
    )
    w.add_argument("--model", default="tiny", help="preset, model directory or hub name")
    w.add_argument("--env", default="searchqa", help="environment name or import path")
    add_env_arg(w)
    w.add_argument("--out", type=Path, help="model directory to write (default: the cache)")
    w.add_argument(
        "--good-fraction",
        type=float,
        default=None,
        help="share of good demos (default per model and task: 0.35; SmolLM2 on searchqa 0.25)",
    )
    w.add_argument(
        "--skill-fraction",
        type=float,
        help="share of demo steps on good demos only, first (default per model and task)",
    )
    w.add_argument("--steps", type=int, help="optimizer steps on demos (default per model)")
    w.add_argument(
        "--drill-steps",
        type=int,
        help="copy-drill steps before the demos (default per model and task: 150 for tiny "
        "on searchqa, else 0)",
    )
    w.add_argument("--batch-size", type=int, help="demos per step (default per model)")
    w.add_argument("--lr", type=float, help="peak learning rate (default per model)")
    w.add_argument(
        "--mix-lr",
        type=float,
        help="peak learning rate of the mixture stage (default per model and task, else --lr)",
    )
    w.add_argument(
        "--practice-seed",
        type=int,
        help="demos on the env's disjoint practice corpus of this seed; -1: on the env's "
        "own train split (the default)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.set_defaults(handler=_warmstart)


def _progress(description: str, total: int):
    from colonnade.launch.live import progress_bar

    bar = progress_bar(_console())
    task = bar.add_task(description, total=total, info="")
    return bar, task


def _console():
    from rich.console import Console

    return Console(stderr=True)


def run_eval(
    model: str,
    env_name: str,
    split: str,
    n: int,
    precision: str,
    device: str,
    temperature: float,
    batch_size: int,
    seed: int,
    greedy: bool,
    engine: str = "torch",
    env_kwargs: dict | None = None,
) -> dict:
    from colonnade.envs import load_environment
    from colonnade.model import resolve_model
    from colonnade.rollout import SamplingParams, load_engine
    from colonnade.rollout.evaluate import evaluate

    env = load_environment(env_name, **(env_kwargs or {}))
    tasks = list(env.tasks(split))[:n]
    if not tasks:
        raise ValueError(f"split {split!r} of {env_name} has no tasks")
    path = resolve_model(model, env.tokenizer_texts())
    runner = load_engine(path, precision, device, engine=engine)
    passes = [("sampled", temperature)] + ([("greedy", 0.0)] if greedy else [])
    bar, task = _progress("eval", len(tasks) * len(passes))
    out: dict = {}
    with bar:
        for i, (name, temp) in enumerate(passes):
            done = i * len(tasks)
            figures = evaluate(
                runner,
                env,
                tasks,
                SamplingParams(temperature=temp),
                batch_size,
                seed,
                progress=lambda k, _t, done=done, name=name: bar.update(
                    task, completed=done + k, info=name
                ),
            )
            if name == "sampled":
                out.update(figures)
            else:
                out["greedy"] = figures
    out["temperature"] = temperature
    return out


def _eval(args: argparse.Namespace) -> int:
    from colonnade.model.mlx_llama import MlxUnavailable

    from .main import CliError

    if args.n < 1 or args.batch_size < 1:
        raise CliError("-n and --batch-size must be at least 1")
    kwargs = env_kwargs(args)
    try:
        out = run_eval(
            args.model,
            args.env,
            args.split,
            args.n,
            args.precision,
            args.device,
            args.temperature,
            args.batch_size,
            args.seed,
            not args.no_greedy,
            args.engine,
            kwargs,
        )
    except (ValueError, FileNotFoundError, MlxUnavailable) as e:
        raise CliError(str(e)) from None
    if args.json:
        print(json.dumps(out))
        return 0
    rows = [("sampled", out)] + ([("greedy", out["greedy"])] if "greedy" in out else [])
    print(f"{args.env} {args.split}, n={out['n']}, {args.precision}; pass@1: {out['success']}")
    keys = [k for k, v in out.items() if isinstance(v, float) and k != "temperature"]
    width = max([12, *(len(k) + 2 for k in keys)])
    print(f"{'':10}" + "".join(f"{k:>{width}}" for k in keys))
    for name, figs in rows:
        print(f"{name:10}" + "".join(f"{figs.get(k, float('nan')):>{width}.3f}" for k in keys))
    return 0


def _warmstart(args: argparse.Namespace) -> int:
    from colonnade.train.warmstart import WarmstartConfig, total_steps, warmstart

    from .main import CliError

    cfg = WarmstartConfig(
        model=args.model,
        env=args.env,
        env_kwargs=env_kwargs(args) or {},
        steps=args.steps,
        drill_steps=args.drill_steps,
        practice_seed=args.practice_seed,
        mix_lr=args.mix_lr,
        skill_fraction=args.skill_fraction,
        batch_size=args.batch_size,
        lr=args.lr,
        seed=args.seed,
    )
    if args.good_fraction is not None:
        cfg.good_fraction = args.good_fraction
    res = cfg.resolved()
    bar, task = _progress("warm start", total_steps(res))
    try:
        with bar:
            path, built = warmstart(
                cfg,
                args.out,
                progress=lambda s, n, loss: bar.update(task, completed=s, info=f"loss {loss:.3f}"),
            )
    except (ValueError, FileExistsError, TypeError) as e:
        raise CliError(str(e)) from None
    print(f"{'built' if built else 'reused'} {path}", file=sys.stderr)
    print(path)
    return 0
