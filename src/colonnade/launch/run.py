"""The run itself: warm start → eval before → trainer + workers → eval after → report.

Everything a report needs is written to the store (`report/…`) as it
happens, so an interrupted run still reports what it did, and `colonnade
report` can rebuild the report later from the store alone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import time
from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path

from rich.console import Console
from rich.live import Live

from colonnade.config import RunConfig, TrainerConfig
from colonnade.envs import Demonstrating, Metric, load_environment, metrics_of, tokenizer_texts_of
from colonnade.model import resolve_model
from colonnade.operate.export import export_version
from colonnade.progress import Tracker
from colonnade.protocol import keys, latest_version
from colonnade.protocol.presence import alive
from colonnade.protocol.reader import open_run
from colonnade.protocol.schemas import SchemaError
from colonnade.protocol.signing import new_keypair
from colonnade.rollout.evaluate import figures_line
from colonnade.store import NotFound, ObjectStore, open_store
from colonnade.train.warmstart import WarmstartConfig, total_steps, warmstart

from . import evaluation
from .config import effective_tables, eval_sampling, role_configs, to_toml
from .live import ALIVE_SECONDS, log_line, render, snapshot
from .processes import Child, EarlyStop, spawn, stop_all, terminate_as_interrupt, wait_exit

log = logging.getLogger("colonnade.run")
SAMPLES_SHOWN = 3  # episodes of each held-out eval kept for the report


class RunFailed(RuntimeError):
    """A child process failed; the report says what was done before."""


def prepare(cfg: RunConfig) -> RunConfig:
    """Fix the run directory (runs/<timestamp> unless given)."""
    out = cfg.out or str(Path("runs") / datetime.now().strftime("%Y%m%d-%H%M%S"))
    return dataclasses.replace(cfg, out=out)


def _warm(cfg: RunConfig, trainer: TrainerConfig, console: Console) -> str:
    """The model directory the run starts from: the warm start's, or the model
    itself resolved as the trainer resolves it (a preset name is no hub name)."""
    env = load_environment(cfg.env, **trainer.env_kwargs)
    if cfg.warmstart and not isinstance(env, Demonstrating):
        console.print(
            f"warm start: skipped, environment {cfg.env} has no demonstrations "
            "(no demonstration() method); RL starts from the model as given"
        )
    if not cfg.warmstart or not isinstance(env, Demonstrating):
        return resolve_model(cfg.model, partial(tokenizer_texts_of, env))
    ws = WarmstartConfig(
        model=cfg.model,
        env=cfg.env,
        env_kwargs=dict(trainer.env_kwargs),
        good_fraction=cfg.good_fraction,
        steps=cfg.warmstart_steps,
        drill_steps=cfg.warmstart_drill_steps,
    )
    with Tracker("warm start", total_steps(ws.resolved()), console) as bar:
        path, built = warmstart(ws, progress=lambda s, _n, loss: bar.update(s, f"loss {loss:.3f}"))
    console.print(f"warm start: {'built' if built else 'reused'} {path}")
    return str(path)


def _eval(
    cfg: RunConfig, trainer: TrainerConfig, store: ObjectStore, which: str, engine, console
) -> dict:
    env = load_environment(cfg.env, **trainer.env_kwargs)
    n = min(cfg.eval_n, len(env.tasks("test")))
    with Tracker(f"eval {which}", n, console) as bar:
        figures = evaluation.run_eval(
            engine,
            env,
            n,
            eval_sampling(cfg),
            cfg.eval_batch,
            lambda k, _t, passed: bar.update(k, f"pass@1 {passed:.3f}"),
            show=SAMPLES_SHOWN,
        )
    figures["version"] = engine.version
    store.put(keys.EVAL[which], json.dumps(figures).encode())
    console.print(f"eval {which} (v{engine.version}): {figures_line(figures)}")
    return figures


def _launch_children(cfg: RunConfig, model_path: str, store: ObjectStore) -> list[Child]:
    out = Path(cfg.out)
    trainer, worker = role_configs(cfg, model_path)
    (out / "trainer.toml").write_text(to_toml({"": dataclasses.asdict(trainer)}))
    (out / "worker.toml").write_text(to_toml({"": dataclasses.asdict(worker)}))
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    if not Path(trainer.key).exists():  # the trainer's, made once per out folder
        new_keypair("trainer", Path(trainer.key).parent)
    if trainer.worker_keys:  # the trainer reads the .pub files at start
        for i in range(cfg.workers):
            if not (Path(trainer.worker_keys) / f"w{i + 1}.key").exists():
                new_keypair(f"w{i + 1}", Path(trainer.worker_keys))
    trainer_args = ["trainer", "--config", str(out / "trainer.toml")]
    children = [spawn("trainer", trainer_args, logs, cfg.threads, cfg.trainer_ranks)]
    deadline = time.monotonic() + 300
    while not store.exists(keys.RUN):
        if not children[0].alive:
            raise RunFailed(f"the trainer exited early:\n{children[0].tail()}")
        if time.monotonic() > deadline:
            raise RunFailed("the trainer wrote no run.json in 300 s")
        time.sleep(0.3)
    for i in range(cfg.workers):
        args = ["worker", "--config", str(out / "worker.toml"), "--id", f"w{i + 1}"]
        args += _stage_args(cfg, i)
        if trainer.worker_keys:
            args += ["--key", str(Path(trainer.worker_keys) / f"w{i + 1}.key")]
        if cfg.metrics_port is not None:
            args += ["--metrics-port", str(cfg.metrics_port + 1 + i)]
        children.append(spawn(f"worker-{i + 1}", args, logs, cfg.threads))
    return children


def _stage_args(cfg: RunConfig, i: int) -> list[str]:
    """Worker i's place in its pipeline group (`cfg.stages` consecutive
    workers a group), or none where each worker holds the whole model."""
    if not cfg.stages:
        return []
    n = cfg.stages
    first = i - i % n
    group = ",".join(f"w{j + 1}" for j in range(first, first + n))
    return ["--stage", f"{i % n + 1}/{n}", "--stage-group", group]


def _during(cfg: RunConfig, env, store: ObjectStore, console: Console) -> evaluation.EvalDuring:
    def said(figures: dict) -> None:
        console.print(f"held-out at v{figures['version']}: {figures_line(figures)}")

    return evaluation.EvalDuring(
        store,
        env,
        cfg.eval_during_n,  # run_eval takes at most the test split
        eval_sampling(cfg),
        cfg.eval_batch,
        cfg.eval_every,
        _engine(cfg),
        said,
    )


def _watch(
    cfg: RunConfig,
    max_versions: int,
    store: ObjectStore,
    children: list[Child],
    console: Console,
    stop: EarlyStop,
    metrics: tuple[Metric, ...] = (),
    on_version: Callable[[int], None] | None = None,
) -> str | None:
    """Until the trainer exits: the EarlyStop reason it was told to stop for, if
    any; raises RunFailed if it fails.

    The live view only on a terminal (elsewhere rich's Live prints nothing
    until it ends); else a line per version, again every `interval()` s while
    none comes, and until the first version a progress line (`Tracker`).
    """
    reported_dead: set[str] = set()
    last_v, last_line, told = -1, 0.0, None
    view = Live(console=console, refresh_per_second=2) if cfg.live and console.is_terminal else None
    waiting = Tracker("waiting for v1", None, console) if view is None else None

    def tick() -> None:
        nonlocal last_v, last_line
        snap = snapshot(store, max_versions, metrics)
        for c in children[1:]:
            if not c.alive and c.name not in reported_dead:
                reported_dead.add(c.name)
                console.print(f"[yellow]{c.name} exited ({c.proc.returncode}); see {c.log}")
        if view is not None:
            view.update(render(snap, "training"))
        elif snap.version < 1:
            n = len(alive(snap.workers, time.time(), ALIVE_SECONDS))
            waiting.update(0, f"{n} of {cfg.workers} workers alive")
        elif snap.version != last_v or time.monotonic() - last_line >= waiting.every:
            waiting.close()  # the first version is in
            console.print(log_line(snap))
            last_line = time.monotonic()
        last_v = snap.version
        if on_version is not None and snap.version >= 1:
            on_version(snap.version)

    with view or waiting:
        while children[0].alive:
            tick()
            if told is None and (told := stop.reason()) is not None:
                _tell_trainer_to_stop(children[0], told, console)
            time.sleep(1.0)
        tick()
    if children[0].proc.returncode != 0:
        raise RunFailed(
            f"the trainer exited with {children[0].proc.returncode}:\n{children[0].tail()}"
        )
    return told


def _tell_trainer_to_stop(trainer: Child, reason: str, console: Console) -> None:
    """SIGTERM: the trainer finishes the version in flight, checkpoints and exits."""
    why = "max_minutes spent" if reason == EarlyStop.BUDGET else "interrupted (Ctrl-C again aborts)"
    console.print(
        f"[yellow]{why}: the trainer stops after the version in flight; "
        "the final model, its eval and the report follow"
    )
    trainer.proc.send_signal(signal.SIGTERM)


def launch(cfg: RunConfig, console: Console | None = None) -> dict:
    """Run everything; the report dict (also written as report.json / report.html)."""
    from colonnade.report import build_report, render_html

    console = console or Console(stderr=True)
    _quiet_transformers()
    cfg = prepare(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.toml").write_text(to_toml(effective_tables(cfg)))
    trainer_cfg, _ = role_configs(cfg)
    store = open_store(trainer_cfg.store, endpoint_url=cfg.endpoint_url)
    if store.exists(keys.RUN):
        raise ValueError(f"{store.url} already holds a run; choose another --out or --store")
    started = time.time()
    facts = {
        "preset": cfg.preset,
        "model": cfg.model,
        "env": cfg.env,
        "workers": cfg.workers,
        "trainer_ranks": cfg.trainer_ranks,
        "started": started,
        "status": "running",
        "out": str(out),
        "max_minutes": cfg.max_minutes,
        "config": effective_tables(cfg),  # the report shows the settings it ran with
    }
    with terminate_as_interrupt():
        _supervise(cfg, trainer_cfg, store, facts, started, console, EarlyStop(cfg.max_minutes))
    report = build_report(store)
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.html").write_text(render_html(report))
    console.print(f"report: {out / 'report.json'}, {out / 'report.html'}")
    return report


def _supervise(
    cfg: RunConfig,
    trainer_cfg: TrainerConfig,
    store: ObjectStore,
    facts: dict,
    started: float,
    console: Console,
    stop: EarlyStop,
) -> None:
    """Warm start, evaluate, run the children to the end (max_versions, the
    budget, or a first Ctrl-C while they run), export and evaluate the final
    version (also when the trainer failed: the last one it published);
    whatever happens, stop them and record how the run ended in `facts`
    (status: finished, budget, interrupted, failed) and the store."""
    children: list[Child] = []
    try:
        model_path = _warm(cfg, trainer_cfg, console)
        if cfg.eval_n:
            _eval(
                cfg,
                trainer_cfg,
                store,
                "before",
                evaluation.model_engine(model_path, _engine(cfg)),
                console,
            )
        if stop.reason() == EarlyStop.BUDGET:
            facts["status"] = "budget"
            console.print("[yellow]max_minutes spent before training began: no trainer started")
            return
        with stop.catching():
            children += _launch_children(cfg, model_path, store)
            _write_launch(store, facts, started)
            env = load_environment(cfg.env, **trainer_cfg.env_kwargs)
            during = _during(cfg, env, store, console)
            try:
                told = _watch(cfg, trainer_cfg.max_versions, store, children, console, stop,
                              metrics_of(env), during.poll)  # fmt: skip
            finally:
                during.close()
            if told is None:  # workers stop by themselves once the trainer is done
                wait_exit(children[1:], 60)
            stop_all(children)
        facts["status"] = STATUS[told]
        _after(cfg, trainer_cfg, store, console)
    except KeyboardInterrupt:
        facts["status"] = "interrupted"
        console.print("[yellow]interrupted: stopping the trainer and workers")
    except RunFailed as e:
        facts["status"] = "failed"
        console.print(f"[red]{e}")
        stop_all(children)
        _after_failure(cfg, trainer_cfg, store, console)
    finally:
        stop_all(children)
        _write_launch(store, facts, started)


STATUS = {None: "finished", EarlyStop.BUDGET: "budget", EarlyStop.INTERRUPT: "interrupted"}


def _engine(cfg: RunConfig) -> str:
    # Evaluations run on the workers' engine: the figure is the fleet's policy.
    return str(cfg.worker.get("engine", "auto"))


def _final(store: ObjectStore) -> int | None:
    """The newest version the run's trainer signed (None before run.json)."""
    try:
        return latest_version(store, open_run(store).trust)
    except (NotFound, SchemaError):
        return None


def _after(cfg: RunConfig, trainer: TrainerConfig, store: ObjectStore, console: Console) -> None:
    final = _final(store)
    if final is None:
        return
    export_version(store, final, Path(cfg.out) / "final-model", force=True)
    console.print(f"final model (v{final}): {Path(cfg.out) / 'final-model'}")
    if cfg.eval_n:
        _eval(
            cfg,
            trainer,
            store,
            "after",
            evaluation.version_engine(store, final, _engine(cfg)),
            console,
        )


def _after_failure(
    cfg: RunConfig, trainer: TrainerConfig, store: ObjectStore, console: Console
) -> None:
    """The versions a failed trainer published are in the store, whole: export
    and evaluate the last, so hours of training still end in a figure."""
    final = _final(store)
    if final is None or final < 1:
        return
    console.print(f"[yellow]the trainer failed: exporting and evaluating v{final}, its last")
    try:
        _after(cfg, trainer, store, console)
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: no export or eval of the last version")
    except Exception as e:  # the run has failed already; say why this did too
        console.print(f"[red]the last version could not be exported or evaluated: {e}")


def _quiet_transformers() -> None:
    """Its per-call progress bars would tear through the live view."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _write_launch(store: ObjectStore, facts: dict, started: float) -> None:
    facts["wall_s"] = round(time.time() - started, 1)
    store.put(keys.LAUNCH, json.dumps(facts).encode())
