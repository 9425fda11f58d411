"""`colonnade eval` and `colonnade warmstart`: a model's figures, and a weak base."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

from colonnade.choices import ENGINE_CHOICES, RUN_PRECISIONS

from .envargs import add_env_arg, env_kwargs

if TYPE_CHECKING:
    from colonnade.engine import Engine


def register(sub: argparse._SubParsersAction) -> None:
    from .export import published_flags

    e = sub.add_parser(
        "eval",
        help="pass@1 (pass@k) and the environment's metrics of a model on an environment split",
        description="Evaluate a model on an environment split with the rollout engine "
        "(int8 by default, as workers run it): pass@1 (the environment's declared success; "
        "the output names the rule), sampled at --temperature and greedy, mean reward and "
        "the mean of every metric the environment reports; with -k, pass@k and mean@k. "
        "Turn and token limits are a run's: those of the run preset made for --env "
        "(smoke: smoke, else demo), or of --preset / --config. A published version of a "
        "run (--model STORE@vN) is rebuilt from the store as a worker rebuilds it and runs "
        "at the run's published precision; its run.json gives the environment and the "
        "limits unless --env, --preset or --config is given.",
    )
    e.add_argument(
        "--model",
        required=True,
        help="model directory, preset or hub name; or a published version of a run: "
        "STORE@vN (a store folder, run directory or s3:// prefix; STORE alone: its newest)",
    )
    e.add_argument(
        "--env",
        help="environment name or import path (default: --config's or the run's, else searchqa)",
    )
    add_env_arg(e)
    e.add_argument(
        "--preset", help="run preset whose limits to use (default: the one made for --env)"
    )
    e.add_argument("--config", type=Path, help="a run's run.toml: its env, env_kwargs and limits")
    e.add_argument("--max-turn-tokens", type=int, help="model tokens a turn (default: the run's)")
    e.add_argument(
        "--max-episode-tokens", type=int, help="tokens an episode after the prompt (the run's)"
    )
    e.add_argument("--split", default="test", choices=["train", "test"])
    e.add_argument("-n", type=int, default=500, help="tasks to run (first n of the split)")
    e.add_argument(
        "-k",
        type=int,
        default=1,
        help="samples per task of the sampled pass: pass@k (any of the k solved) and "
        "mean@k (the share solved, averaged over tasks)",
    )
    e.add_argument(
        "--show", type=int, default=0, metavar="N", help="print N sampled completions and rewards"
    )
    e.add_argument(
        "--precision",
        choices=RUN_PRECISIONS,
        help="of a model (default int8, as workers run it); a published version runs at its run's",
    )
    e.add_argument("--device", default="cpu", help="cpu | cuda | mps | auto (torch engine)")
    e.add_argument("--engine", default="torch", choices=ENGINE_CHOICES, help="rollout engine")
    e.add_argument("--temperature", type=float, default=1.0, help="of the sampled pass")
    e.add_argument("--batch-size", type=int, default=50, help="episodes a batch")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--no-greedy", action="store_true", help="skip the greedy pass")
    e.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    published_flags(e)
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


def _console():
    from rich.console import Console

    return Console(stderr=True)


def run_eval(
    model: str | Engine,
    env_name: str,
    split: str,
    n: int,
    params,
    *,
    precision: str = "int8",
    device: str = "cpu",
    batch_size: int = 50,
    seed: int = 0,
    greedy: bool = True,
    engine: str = "torch",
    env_kwargs: dict | None = None,
    k: int = 1,
    show: int = 0,
) -> dict:
    """The figures of the sampled pass (`params`, k samples a task), `greedy` (one
    a task at temperature 0), and with `show` the first `show` sampled episodes.

    `model`: a model directory, preset or hub name, loaded at `precision` on
    `device`; or an engine already built (a published version)."""
    from dataclasses import replace

    from colonnade.engine import load_engine
    from colonnade.envs import load_environment, tokenizer_texts_of
    from colonnade.model import resolve_model
    from colonnade.progress import Tracker
    from colonnade.rollout.evaluate import evaluate

    env = load_environment(env_name, **(env_kwargs or {}))
    tasks = list(env.tasks(split))[:n]
    if not tasks:
        raise ValueError(f"split {split!r} of {env_name} has no tasks")
    if isinstance(model, str):
        path = resolve_model(model, partial(tokenizer_texts_of, env))
        runner = load_engine(path, precision, device, engine=engine)
    else:
        runner = model
    # Greedy samples are all alike: one a task.
    passes = [("sampled", params, k)] + (
        [("greedy", replace(params, temperature=0.0), 1)] if greedy else []
    )
    out: dict = {}
    with Tracker("eval", len(tasks) * (k + greedy), _console()) as bar:
        for name, p, samples in passes:
            done = out.get("n", 0) * k if name == "greedy" else 0
            figures = evaluate(
                runner,
                env,
                tasks,
                p,
                batch_size,
                seed,
                lambda d, _t, passed, done=done, name=name: bar.update(
                    done + d, f"{name} pass@1 {passed:.3f}"
                ),
                samples,
                show=show if name == "sampled" else 0,
            )
            if name == "sampled":
                out.update(figures)
            else:
                out["greedy"] = figures
    out["temperature"] = params.temperature
    out["limits"] = {
        "max_turn_tokens": params.max_turn_tokens,
        "max_episode_tokens": params.max_episode_tokens,
    }
    return out


def _run_settings(args: argparse.Namespace):
    """(env, env_kwargs, sampling, where the limits come from): as a run with these
    flags would evaluate (`launch.config.eval_sampling`), then eval's own flags."""
    from dataclasses import replace

    from colonnade.launch.config import (
        eval_sampling,
        preset_for_env,
        resolve_run_config,
        role_configs,
    )

    preset = args.preset or (preset_for_env(args.env) if args.env and not args.config else None)
    cfg = resolve_run_config(preset, args.config, env_kwargs=env_kwargs(args), env=args.env)
    trainer, _ = role_configs(cfg)
    limits = _limits(args)
    params = replace(eval_sampling(cfg), temperature=args.temperature, **limits)
    source = "flags" if len(limits) == 2 else f"run preset {cfg.preset}"
    if args.config and len(limits) < 2:
        source += f", {args.config}"
    return cfg.env, trainer.env_kwargs, params, source


def _limits(args: argparse.Namespace) -> dict[str, int]:
    """The turn and token limits given as flags."""
    return {
        k: v
        for k in ("max_turn_tokens", "max_episode_tokens")
        if (v := getattr(args, k)) is not None
    }


def _spec_settings(args: argparse.Namespace, spec):
    """(env, env_kwargs, sampling, where the limits come from) of the run that
    published a version: its run.json's, as its workers sample, then eval's
    own flags (--env-arg key by key over the run's)."""
    from dataclasses import replace

    from colonnade.protocol.turns import SamplingParams

    sampling = dict(spec.sampling)
    sampling["stop"] = tuple(sampling.get("stop", ()))
    limits = _limits(args)
    params = replace(SamplingParams(**sampling), temperature=args.temperature, **limits)
    kwargs = {**spec.env_kwargs, **(env_kwargs(args) or {})}
    return spec.env, kwargs, params, "flags" if len(limits) == 2 else "the run's run.json"


def _published(args: argparse.Namespace):
    """(engine, precision, settings) of --model STORE@vN: the version rebuilt
    as a worker rebuilds it, run at the run's published precision."""
    from .export import published_engine

    runner, spec = published_engine(args)
    own = args.env or args.preset or args.config
    settings = _run_settings(args) if own else _spec_settings(args, spec)
    return runner, spec.precision, settings


def _eval(args: argparse.Namespace) -> int:
    from colonnade.engine import BackendUnavailable
    from colonnade.operate.export import names_a_run

    from .export import read_errors
    from .main import CliError

    if min(args.n, args.batch_size, args.k) < 1 or args.show < 0:
        raise CliError("-n, -k and --batch-size must be at least 1, --show at least 0")
    try:
        if names_a_run(args.model):
            model, precision, settings = _published(args)
        else:
            model, precision, settings = args.model, args.precision or "int8", _run_settings(args)
        env, kwargs, params, source = settings
        out = run_eval(
            model,
            env,
            args.split,
            args.n,
            params,
            precision=precision,
            device=args.device,
            batch_size=args.batch_size,
            seed=args.seed,
            greedy=not args.no_greedy,
            engine=args.engine,
            env_kwargs=kwargs,
            k=args.k,
            show=args.show,
        )
    except (FileNotFoundError, BackendUnavailable, *read_errors()) as e:
        raise CliError(str(e)) from None
    out["precision"] = precision
    if not isinstance(model, str):
        out["version"] = model.version
    if args.json:
        print(json.dumps(out))
        return 0
    _print_samples(out.get("samples", []))
    _print_figures(out, env, args, source)
    return 0


def _print_samples(samples: list[dict]) -> None:
    for i, s in enumerate(samples, 1):
        verdict = "solved" if s["solved"] else "not solved"
        print(f"--- sample {i}: task {s['task']}, reward {s['reward']:.3f} ({verdict}), "
              f"ended: {s['finish']}")  # fmt: skip
        print(f"question: {s['question']}")
        print(s["completion"])
    if samples:
        print("---")


def _print_figures(out: dict, env: str, args: argparse.Namespace, source: str) -> None:
    rows = [("sampled", out)] + ([("greedy", out["greedy"])] if "greedy" in out else [])
    lim = out["limits"]
    what = f"v{out['version']}, " if "version" in out else ""
    print(f"{env} {args.split}, n={out['n']}, {what}{out['precision']}; pass@1: {out['success']}")
    print(f"limits: {lim['max_turn_tokens']} tokens a turn, {lim['max_episode_tokens']} "
          f"an episode ({source})")  # fmt: skip
    if out.get("k"):
        print(f"k={out['k']} samples a task: pass@{out['k']} = any solved, "
              f"mean@{out['k']} = share solved")  # fmt: skip
    keys = [k for k, v in out.items() if isinstance(v, float) and k != "temperature"]
    width = max([12, *(len(k) + 2 for k in keys)])
    print(f"{'':10}" + "".join(f"{k:>{width}}" for k in keys))
    for name, figs in rows:
        print(f"{name:10}" + "".join(f"{figs.get(k, float('nan')):>{width}.3f}" for k in keys))


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
    from colonnade.progress import Tracker

    try:
        with Tracker("warm start", total_steps(cfg.resolved()), _console()) as bar:
            path, built = warmstart(
                cfg, args.out, progress=lambda s, _n, loss: bar.update(s, f"loss {loss:.3f}")
            )
    except (ValueError, FileExistsError, TypeError) as e:
        raise CliError(str(e)) from None
    print(f"{'built' if built else 'reused'} {path}", file=sys.stderr)
    print(path)
    return 0
