"""Held-out evaluation inside a run: of a model directory, or of a published version.

"After" evaluates the newest published version through the same path a
worker runs it (int8 codes from the store, verified by hash), so the figure
is that of the policy the fleet runs, not of the trainer's float weights.
"""

from __future__ import annotations

from pathlib import Path

import torch

from colonnade.envs import Environment
from colonnade.model import load_dequantized, tied_aliases
from colonnade.protocol import Follower, RunSpec, keys
from colonnade.protocol.model_files import fetch_model
from colonnade.protocol.schemas import MAX_JSON_BYTES
from colonnade.rollout import SamplingParams, load_engine
from colonnade.rollout.engine import Engine
from colonnade.rollout.evaluate import Progress, evaluate
from colonnade.rollout.loader import engine_for, resolve_engine
from colonnade.store import ObjectStore


def _version_state(store: ObjectStore, version: int):
    spec = RunSpec.from_json(store.get(keys.RUN, max_bytes=MAX_JSON_BYTES))
    model, tok = fetch_model(store, spec)
    follower = Follower(store, spec.anchor_every)
    follower.sync(version)
    return spec, model, tok, follower


def version_engine(store: ObjectStore, version: int, engine: str = "torch") -> Engine:
    """The published `version` on the engine a worker with `--engine engine` runs."""
    spec, model, tok, follower = _version_state(store, version)
    return engine_for(model, tok, follower.state, spec.precision, torch.device("cpu"),
                      resolve_engine(engine), version)  # fmt: skip


def export_version(store: ObjectStore, version: int, out: Path) -> Path:
    """A normal model directory (float weights, config, tokenizer) of a published version."""
    _, model, tok, follower = _version_state(store, version)
    load_dequantized(model, follower.state, tied_aliases(model))
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def run_eval(
    engine: Engine,
    env: Environment,
    n: int,
    params: SamplingParams,
    batch_size: int,
    progress: Progress | None = None,
    show: int = 0,
) -> dict:
    tasks = list(env.tasks("test"))[:n]
    figures = evaluate(engine, env, tasks, params, batch_size, seed=0, progress=progress, show=show)
    figures["temperature"] = params.temperature
    return figures


def model_engine(path: str, engine: str = "torch") -> Engine:
    return load_engine(path, "int8", "cpu", engine=engine)
