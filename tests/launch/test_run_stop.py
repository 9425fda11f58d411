"""Ending a run early: the wall-clock budget (max_minutes) and a first Ctrl-C stop
the trainer after its version and still export and evaluate; a second Ctrl-C aborts.
The trainer here is a stand-in process that exits 0 on SIGTERM, as the trainer does."""

import io
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from rich.console import Console

from colonnade.config import RunConfig
from colonnade.launch import run as launch_run
from colonnade.launch.config import resolve_run_config, role_configs
from colonnade.launch.processes import Child, EarlyStop
from colonnade.protocol import keys
from colonnade.store import LocalStore

STAND_IN = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\n"
    "print('up', flush=True)\n"
    "time.sleep(120)\n"
)


def _stand_in(tmp_path, script: str = STAND_IN) -> Child:
    log = tmp_path / "trainer.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", script], stdout=out, stdin=subprocess.DEVNULL
        )
    # Wait until its SIGTERM handler is in place, as the trainer's is before it
    # writes run.json, which the launcher awaits before it watches.
    while b"up" not in log.read_bytes():
        time.sleep(0.02)
    return Child("trainer", proc, log)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_budget_and_interrupts():
    clock = Clock()
    stop = EarlyStop(max_minutes=2, clock=clock)
    assert stop.reason() is None
    clock.now = 119.9
    assert stop.reason() is None
    clock.now = 120
    assert stop.reason() == EarlyStop.BUDGET
    stop.interrupt()
    assert stop.reason() == EarlyStop.INTERRUPT  # the user's word first
    with pytest.raises(KeyboardInterrupt):
        stop.interrupt()
    assert EarlyStop().reason() is None  # no budget


def test_first_sigint_is_a_request_the_second_aborts():
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN under `nohup ... &`
    stop = EarlyStop()
    with stop.catching():
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.reason() == EarlyStop.INTERRUPT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before  # put back as it was


@pytest.fixture
def run(tmp_path, monkeypatch):
    """_supervise with the warm start and evals stubbed and a stand-in trainer."""
    calls: dict = {"after": 0, "launched": 0}
    monkeypatch.setattr(launch_run, "_warm", lambda *a: "/models/tiny")
    monkeypatch.setattr(launch_run, "_after", lambda *a: calls.__setitem__("after", 1))

    def supervise(stop: EarlyStop, on_launch=lambda: None, script=STAND_IN) -> tuple[dict, str]:
        def children(cfg, model_path, store):
            calls["launched"] += 1
            calls["trainer"] = _stand_in(tmp_path, script)
            on_launch()
            return [calls["trainer"]]

        monkeypatch.setattr(launch_run, "_launch_children", children)
        cfg = RunConfig(env="smoke", eval_n=0, live=False, workers=0, out=str(tmp_path))
        trainer, _ = role_configs(cfg)
        store = LocalStore(tmp_path / "store")
        facts = {"status": "running"}
        out = io.StringIO()
        launch_run._supervise(cfg, trainer, store, facts, 0.0, Console(file=out), stop)
        assert store.exists(keys.LAUNCH)
        return facts, out.getvalue()

    return supervise, calls


def test_a_spent_budget_stops_the_trainer_and_still_exports_and_evaluates(run):
    supervise, calls = run
    clock = Clock()
    stop = EarlyStop(max_minutes=1, clock=clock)
    facts, said = supervise(stop, on_launch=lambda: setattr(clock, "now", 60.0))
    assert facts["status"] == "budget" and calls["after"] == 1, said
    assert calls["trainer"].proc.returncode == 0  # it got SIGTERM and exited cleanly
    assert "max_minutes spent: the trainer stops after the version in flight" in said
    assert "waiting for v1: 0 of 0 workers alive, 0s elapsed" in said  # not a terminal


def test_a_budget_spent_before_training_starts_no_trainer(run):
    supervise, calls = run
    clock = Clock()
    stop = EarlyStop(max_minutes=1, clock=clock)
    clock.now = 60.0  # during the warm start and the eval before
    facts, said = supervise(stop)
    assert facts["status"] == "budget" and calls["launched"] == 0 and calls["after"] == 0
    assert "before training began" in said


def test_first_ctrl_c_stops_gracefully_a_second_aborts(run):
    supervise, calls = run
    ctrl_c = lambda: threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()  # noqa: E731
    facts, said = supervise(EarlyStop(), on_launch=ctrl_c)
    assert facts["status"] == "interrupted" and calls["after"] == 1
    assert "interrupted (Ctrl-C again aborts): the trainer stops after" in said

    calls["after"] = 0
    stop = EarlyStop()
    stop.interrupted = True  # a Ctrl-C already pressed: the next one aborts
    facts, said = supervise(stop, on_launch=ctrl_c)
    assert facts["status"] == "interrupted" and calls["after"] == 0
    assert calls["trainer"].proc.poll() is not None  # stopped all the same
    assert "interrupted: stopping the trainer and workers" in said


def test_a_failed_trainer_still_ends_in_its_last_version_exported_and_evaluated(run, monkeypatch):
    supervise, calls = run
    dies = "print('up', flush=True)\nprint('killed for memory', flush=True)\nraise SystemExit(1)\n"
    monkeypatch.setattr(launch_run, "_final", lambda store: 40)
    facts, said = supervise(EarlyStop(), script=dies)
    assert facts["status"] == "failed" and calls["after"] == 1, said
    assert "the trainer exited with 1" in said and "killed for memory" in said
    assert "exporting and evaluating v40, its last" in said
    # Nothing published beyond the base model: nothing to export.
    calls["after"] = 0
    monkeypatch.setattr(launch_run, "_final", lambda store: 0)
    facts, said = supervise(EarlyStop(), script=dies)
    assert facts["status"] == "failed" and calls["after"] == 0, said

    def broken(*a):
        raise OSError("disk full")

    monkeypatch.setattr(launch_run, "_final", lambda store: 40)
    monkeypatch.setattr(launch_run, "_after", broken)
    facts, said = supervise(EarlyStop(), script=dies)
    assert facts["status"] == "failed" and "could not be exported or evaluated: disk full" in said


def test_the_last_version_is_the_newest_the_runs_trainer_signed(tmp_path, signed_run):
    import torch
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade.protocol import Publisher
    from colonnade.protocol.signing import Signer

    store = LocalStore(tmp_path)
    assert launch_run._final(store) is None  # no run.json: nothing to export
    signer = signed_run(store)
    assert launch_run._final(store) is None  # a run, no version yet
    pub = Publisher(store, signer, "bf16", anchor_every=10)
    for i in range(3):
        pub.publish({"w": torch.full((4,), float(i))})
    assert launch_run._final(store) == 2
    # A version someone else signed (the workers' credentials) is not the run's.
    other = Signer(Ed25519PrivateKey.generate(), signer.run_id)
    key = keys.meta_key(3)
    store.put(key, other.seal(key, pub.meta.to_dict() | {"version": 3}))
    assert launch_run._final(store) == 2


def test_max_minutes_in_the_run_toml_and_as_a_flag(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text("max_minutes = 90\n")
    assert resolve_run_config("smoke", f).max_minutes == 90
    assert resolve_run_config("smoke", f, max_minutes=0.5).max_minutes == 0.5
    assert resolve_run_config("smoke").max_minutes is None
    with pytest.raises(ValueError, match="max_minutes must be > 0"):
        resolve_run_config("smoke", max_minutes=0)
