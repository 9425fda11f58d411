"""The run's typed config: run-level settings plus [trainer] and [worker] tables.

    colonnade run --preset smoke --config run.toml --workers 3

Precedence: run preset < TOML file < flags. The [trainer] table overrides
the trainer preset the run preset names, key by key; [worker] likewise for
the worker defaults. Every table is checked against its dataclass, so an
unknown key anywhere is an error naming it. The environment's arguments
live in `[trainer] env_kwargs` (the trainer writes them into run.json for
the workers); `--env-arg k=v` flags go over them key by key, and they are
checked as run.json's reader checks them (`check_env_kwargs`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from colonnade.config import (
    RUN_PRESETS,
    TRAINER_PRESETS,
    RunConfig,
    TrainerConfig,
    WorkerConfig,
    load_config,
)
from colonnade.envs.args import check_env_kwargs

if TYPE_CHECKING:
    from colonnade.protocol.turns import SamplingParams


def _merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def resolve_run_config(
    preset: str | None = None,
    path: Path | None = None,
    env_kwargs: dict | None = None,
    **flags: Any,
) -> RunConfig:
    """The effective RunConfig: preset < file < flags (None flags are ignored).

    `env_kwargs` (from --env-arg) go over `[trainer] env_kwargs` key by key.
    """
    file: dict = {}
    if path is not None:
        try:
            file = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ValueError(f"config {path}: {e}") from None
    env = flags.get("env") or file.get("env")
    name = preset or file.get("preset") or (preset_for_env(env) if env else RunConfig.preset)
    if name not in RUN_PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(RUN_PRESETS)}")
    values = _merge({**RUN_PRESETS[name], "preset": name}, file)
    values = _merge(values, {k: v for k, v in flags.items() if v is not None})
    if env_kwargs and isinstance(values.get("trainer", {}), dict):
        table = dict(values.get("trainer", {}))
        given = table.get("env_kwargs", {})
        table["env_kwargs"] = {**given, **env_kwargs} if isinstance(given, dict) else env_kwargs
        values["trainer"] = table
    cfg = load_config(RunConfig, base=values)
    trainer, _ = role_configs(cfg)  # fail now, not in a child process, on a bad table
    check_env_kwargs(trainer.env_kwargs, "[trainer] env_kwargs")
    return cfg


def preset_for_env(env: str) -> str:
    """The run preset made for `env` (smoke: smoke, searchqa: demo, the first
    named for it), else `custom`: neutral settings, nothing of searchqa's."""
    return next((n for n, p in RUN_PRESETS.items() if p.get("env") == env), "custom")


def eval_sampling(cfg: RunConfig) -> SamplingParams:
    """How the run's held-out evaluations sample, and `colonnade eval` by default:
    the run's eval temperature, the trainer's turn and token limits (the workers'
    own), so an eval's figures and the run's are of the same episodes."""
    trainer, _ = role_configs(cfg)
    from colonnade.protocol.turns import run_sampling  # torch: not on the config path

    return dataclasses.replace(run_sampling(trainer), temperature=cfg.eval_temperature)


TRAINER_KEY = "trainer-key/trainer.key"  # under the run's out folder
# Paths the run makes under its out folder, which a table may name otherwise;
# left empty (as `config show` writes them before the folder is known) they
# are the run's.
_RUN_PATHS = ("key", "worker_keys", "trust")


def role_configs(cfg: RunConfig, model_path: str | None = None):
    """(TrainerConfig, WorkerConfig) the run's processes will use.

    Paths under the run's folder (the store, the trainer's key, the workers'
    keys) only once `out` is known (`launch.run.prepare` fixes it): until
    then they are left to each role's own default, never a placeholder."""
    table = dict(cfg.trainer)
    preset = table.pop("preset", None)
    base = dict(TRAINER_PRESETS.get(preset, {})) if preset else {}
    if preset and preset not in TRAINER_PRESETS:
        raise ValueError(f"[trainer] preset {preset!r} is not one of {', '.join(TRAINER_PRESETS)}")
    out = Path(cfg.out) if cfg.out else None
    store = cfg.store or (str(out / "store") if out else "")
    run = {"store": store, "endpoint_url": cfg.endpoint_url}
    decided = {**run, "env": cfg.env, "model": cfg.model, "metrics_port": cfg.metrics_port,
               "metrics_host": cfg.metrics_host}  # fmt: skip
    base.update(env=cfg.env, model=model_path or cfg.model)
    if out is not None:
        if cfg.sign:
            base["worker_keys"] = str(out / "keys")
        # The trainer's key, made by the launcher; its workers pin its .pub.
        base["key"] = str(out / TRAINER_KEY)
    trainer = load_config(
        TrainerConfig,
        base={**base, **_own(table, "trainer", decided)},
        store=store,
        endpoint_url=cfg.endpoint_url,
        metrics_port=cfg.metrics_port,
        metrics_host=cfg.metrics_host,
    )
    trust = str(Path(trainer.key).with_suffix(".pub")) if trainer.key else ""
    worker = load_config(
        WorkerConfig,
        base={"trust": trust, **_own(dict(cfg.worker), "worker", {**run, "join": ""})},
        store=store,
        endpoint_url=cfg.endpoint_url,
        metrics_host=cfg.metrics_host,
    )
    return trainer, worker


def _own(table: dict, name: str, decided: dict) -> dict:
    """The [name] table's settings that go over the run's: a setting the run
    decides for its processes (`decided`) may only repeat the run's value, as
    `config show` writes it, and a path the run makes left empty is the run's."""
    out = {}
    for k, v in table.items():
        if k in decided and v not in ("", decided[k]):
            raise ValueError(
                f"[{name}] {k} = {v!r} differs from the run's {decided[k]!r}: "
                f"set {k} at the top level, not in [{name}]"
            )
        if k not in decided and not (k in _RUN_PATHS and v == ""):
            out[k] = v
    return out


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        # JSON's escapes are TOML's too; DEL is the one control JSON leaves raw.
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(k)} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"cannot write {type(v).__name__} as TOML")


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml_value(k)


def to_toml(tables: dict[str, dict]) -> str:
    """TOML text: the "" table's keys first, then one [name] table each; None is left out."""
    lines = []
    for name, values in tables.items():
        if name:
            lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items() if v is not None]
    return "\n".join(lines).lstrip("\n") + "\n"


def effective_tables(cfg: RunConfig) -> dict[str, dict]:
    """What `colonnade config show` prints: every role's settings in full."""
    trainer, worker = role_configs(cfg)
    run = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("trainer", "worker")}
    return {"": run, "trainer": dataclasses.asdict(trainer), "worker": dataclasses.asdict(worker)}
