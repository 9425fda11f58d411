"""Supervised warm start: a weak base policy that RL can lift.

RL cannot improve a policy that never produces the task's format. The warm
start fine-tunes the model on the environment's demonstrations: a
`good_fraction` share of good trajectories (search, then answer from the
information) and the rest poor ones (answer at once with a guess), so the
base model knows the format but mostly guesses. The result is a normal
model directory, keyed by the hash of everything that defines it, so a
second call with the same settings returns it without training.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from colonnade.envs import Demonstrating, Practising, load_environment, tokenizer_texts_of
from colonnade.model import load_model, resolve_model
from colonnade.model.loading import READY, build_once, cache_root
from colonnade.tools.served import ADDRESS_ARGS

from .sft import copy_drill, demonstrations, train_sft

# Defaults for every model and task; then per model: a from-scratch 2M model
# wants a large step, a pretrained 135M one a small step and few of them.
DEFAULTS = {"drill_steps": 0, "skill_fraction": 0.5, "practice_seed": -1, "good_fraction": 0.35}
MODEL_DEFAULTS = {
    "tiny": {"lr": 1e-3, "steps": 800, "batch_size": 8},
    "smollm2-135m": {"lr": 3e-5, "steps": 120, "batch_size": 4},
}
# Tuned for one model on one task: the environment declares these
# (`warmstart_defaults`, model preset -> defaults; searchqa's in its env.py),
# over the model's defaults; `env_defaults` reads them.
# Copy exercises are short, so a drill step takes many at a high rate.
DRILL_BATCH, DRILL_LR = 64, 3e-3
# Demos made for a stage: a warm start takes a few hundred, and a corpus 100×
# the built-in one would otherwise make (served: ask the service for) one of
# every train task. Above the built-in corpus's train split.
MAX_DEMO_TASKS = 4096


@dataclass
class WarmstartConfig:
    """What defines a warm start; None fields take the model's (and task's) default."""

    model: str = "tiny"
    env: str = "searchqa"
    env_kwargs: dict = field(default_factory=dict)
    good_fraction: float | None = None
    # Share of the demo steps on good demos only, before the mixture: a
    # small model learns the skill (copying from the prompt or the tool
    # reply) from clean demos far faster than from a mixture, and the
    # mixture afterwards only sets how often it uses it.
    skill_fraction: float | None = None
    steps: int | None = None
    drill_steps: int | None = None  # copy-drill steps before the demos (`copy_drill`)
    batch_size: int | None = None
    lr: float | None = None
    mix_lr: float | None = None  # peak rate of the mixture stage; None: `lr`
    seed: int = 0
    # Demos from `env.practice(seed)` (a disjoint corpus), not the env itself;
    # -1: the env's own train split.
    practice_seed: int | None = None

    def resolved(self) -> WarmstartConfig:
        d = {
            **DEFAULTS,
            **MODEL_DEFAULTS.get(self.model, MODEL_DEFAULTS["smollm2-135m"]),
            **env_defaults(self.model, self.env, self.env_kwargs),
        }
        given = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        out = dataclasses.replace(self, **{**d, **given})
        if out.mix_lr is None:
            out.mix_lr = out.lr
        if not 0.0 <= out.skill_fraction <= 1.0:
            raise ValueError("skill_fraction must be within [0, 1]")
        if out.drill_steps < 0 or out.steps < 1:
            raise ValueError("drill_steps must be at least 0 and steps at least 1")
        return out

    def key(self, base_path: str) -> str:
        facts = {**dataclasses.asdict(self.resolved()), "base": Path(base_path).name}
        # Where a tool service is and its key say where the answers come
        # from, not what they are: a run against the same corpus at another
        # address reuses the warm start.
        kwargs = facts["env_kwargs"]
        facts["env_kwargs"] = {k: v for k, v in kwargs.items() if k not in ADDRESS_ARGS}
        return hashlib.sha256(json.dumps(facts, sort_keys=True).encode()).hexdigest()[:16]


def env_defaults(model: str, env: str, env_kwargs: dict | None = None) -> dict:
    """The warm-start defaults `env` declares for `model` (its optional
    `warmstart_defaults`: model preset -> {WarmstartConfig field: value}); {} if none."""
    declared = _declared(env, json.dumps(env_kwargs or {}, sort_keys=True))
    out = dict(declared.get(model, {}))
    known = {f.name for f in dataclasses.fields(WarmstartConfig)} - {"model", "env", "env_kwargs"}
    if bad := sorted(set(out) - known):
        raise ValueError(f"environment {env}: warmstart_defaults name no warm-start field: {bad}")
    return out


@functools.lru_cache(maxsize=16)
def _declared(env: str, kwargs_json: str) -> dict:
    loaded = load_environment(env, **json.loads(kwargs_json))
    return dict(getattr(loaded, "warmstart_defaults", None) or {})


def default_dir(cfg: WarmstartConfig, base_path: str) -> Path:
    return cache_root() / "warmstart" / f"{cfg.env}-{cfg.model}-{cfg.key(base_path)}"


def warmstart(
    cfg: WarmstartConfig,
    out: Path | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[Path, bool]:
    """(model directory, whether it was built now rather than reused)."""
    cfg = cfg.resolved()
    env = load_environment(cfg.env, **cfg.env_kwargs)
    if not isinstance(env, Demonstrating):  # before building anything
        raise TypeError(f"environment {env.name!r} has no demonstration() for a warm start")
    base = resolve_model(cfg.model, partial(tokenizer_texts_of, env))
    target = Path(out) if out else default_dir(cfg, base)
    key = cfg.key(base)
    ready = target / READY
    if ready.is_file():
        if json.loads(ready.read_text()).get("warmstart_key") == key:
            return target, False
        raise FileExistsError(f"{target} holds another model; choose another --out")
    if target.exists() and any(target.iterdir()):
        raise FileExistsError(f"{target} exists and is not a warm-start directory")
    if target.exists():
        target.rmdir()

    def build(tmp: Path) -> None:
        torch.manual_seed(cfg.seed)
        model, tok = load_model(base, dtype=torch.float32)
        t0 = time.perf_counter()
        losses: list[float] = []
        demo_env = _demo_env(cfg, env)
        for examples, steps, batch, lr, done in _stages(cfg, env, demo_env, tok):
            losses += train_sft(
                model,
                examples,
                tok.pad_token_id,
                steps,
                batch,
                lr,
                cfg.seed + done,
                progress=(lambda s, loss, d=done: progress(d + s, total_steps(cfg), loss))
                if progress
                else None,
            )
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        summary = {
            "losses_first_last": [losses[0], losses[-1]],
            "seconds": round(time.perf_counter() - t0, 1),
            "examples": min(len(demo_env.tasks("train")), MAX_DEMO_TASKS),
        }
        (tmp / "warmstart.json").write_text(
            json.dumps({"config": dataclasses.asdict(cfg), "base": base, **summary}, indent=1)
        )

    facts = {"warmstart_key": key, "config": dataclasses.asdict(cfg)}
    return build_once(target, build, facts), True


def total_steps(cfg: WarmstartConfig) -> int:
    """Optimizer steps of the whole warm start, drill included (resolved config)."""
    return cfg.drill_steps + cfg.steps


def _stages(cfg: WarmstartConfig, env, demo_env, tok):
    """(examples, steps, batch size, lr, steps before) of each stage, in order.

    The copy drill, then good demos only (the skill), then the mixture (how
    often the skill is used). All from `demo_env`, so that with a practice
    corpus no name of `env` is seen before RL. Examples are built when their
    stage starts.
    """
    drill, skill = cfg.drill_steps, round(cfg.steps * cfg.skill_fraction)
    if drill:
        exercises = copy_drill(tok, tokenizer_texts_of(demo_env), drill * DRILL_BATCH, cfg.seed)
        yield exercises, drill, DRILL_BATCH, DRILL_LR, 0
    stages = ((1.0, skill, 0, cfg.lr), (cfg.good_fraction, cfg.steps - skill, skill, cfg.mix_lr))
    for fraction, steps, done, lr in stages:
        if steps > 0:
            tasks = list(demo_env.tasks("train"))[:MAX_DEMO_TASKS]
            demos = demonstrations(tok, demo_env, tasks, fraction, cfg.seed + done)
            yield demos, steps, cfg.batch_size, lr, drill + done


def _demo_env(cfg: WarmstartConfig, env):
    if cfg.practice_seed < 0:
        return env
    if not isinstance(env, Practising):
        raise TypeError(f"environment {env.name!r} has no practice(); set practice_seed = -1")
    return env.practice(cfg.practice_seed)
