"""`colonnade run` end to end: the report it writes, `colonnade report`, Ctrl-C,
SIGTERM and --max-minutes.

Every run uses the smoke preset shortened by a run.toml so the file stays
within a few minutes on 2 cores: the full run keeps the preset's warm start
and trains 12 versions, enough to learn (held-out pass@1 0.34 -> 0.91-0.94 in
docs/benchmarks.md's last section); the runs that are stopped early take a
short warm start.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from colonnade.protocol.reader import open_run
from colonnade.store import LocalStore
from colonnade.telemetry import trainer_rows

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

REPORT_KEYS = {
    "env", "model", "workers", "eval", "versions_published", "rollouts_consumed",
    "rollouts_dropped_stale", "rollouts_rejected", "gate", "sync", "wall_s",
    "trainer_wait_fraction",
}  # fmt: skip


def _env(tmp_path):
    return {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}


def _config(tmp_path, versions, warmstart_steps=20, eval_n=16):
    f = tmp_path / "run.toml"
    f.write_text(
        f"warmstart_steps = {warmstart_steps}\neval_n = {eval_n}\n"
        f"[trainer]\nmax_versions = {versions}\ncheckpoint_every = 100\n"
    )
    return f


# The run that learns: the preset's warm start, 12 versions, 32 held-out tasks.
VERSIONS, EVAL_N = 12, 32
# Held-out pass@1 rises at least this much (measured: +0.56 to +0.59, three runs;
# one standard error of the after figure at n=32 is about 0.05).
LEARNS = 0.3


def _cli(*args):
    return [sys.executable, "-m", "colonnade.cli.main", *args]


@pytest.mark.timeout(400)
def test_run_writes_a_full_report_and_report_rebuilds_it(tmp_path):
    out = tmp_path / "run"
    cfg = _config(tmp_path, VERSIONS, warmstart_steps=300, eval_n=EVAL_N)
    cmd = _cli("run", "--preset", "smoke", "--config", str(cfg), "--out", str(out), "--no-live")
    p = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "after: pass@1" in p.stdout
    report = json.loads((out / "report.json").read_text())
    assert set(report) >= REPORT_KEYS
    assert report["status"] == "finished" and report["versions_published"] == VERSIONS
    before, after = report["eval"]["before"], report["eval"]["after"]
    assert before["n"] == after["n"] == EVAL_N
    assert before["version"] == 0 and after["version"] == VERSIONS
    # The smoke run learns: held-out pass@1 of the version workers run, against v0's.
    assert after["pass_at_1"] >= before["pass_at_1"] + LEARNS, (before, after)
    assert set(report["workers"]) == {"w1", "w2"}
    assert report["rollouts_consumed"] >= VERSIONS * 4  # 8 groups a step, 2 a batch
    # Patches while the weights move: ~0.2 MB against a 1.7 MB state (docs/benchmarks.md).
    assert report["sync"]["full_bytes"] > 3 * report["sync"]["patch_bytes_median"] > 0
    assert 0 <= report["trainer_wait_fraction"] <= 1
    assert len(report["series"]["version"]) == VERSIONS
    # Held-out evals while training (the smoke preset: every 10 versions), on the curve.
    during = report["eval"]["during"]
    assert during and all(10 <= d["version"] <= VERSIONS and d["n"] > 0 for d in during)
    assert "held-out at v" in p.stdout + p.stderr
    # What smoke declares (format_ok, "format ok") is what the rows and lines show.
    assert set(report["series"]["env_metrics"]) == {"format_ok"}
    assert len(report["series"]["env_metrics"]["format_ok"]) == VERSIONS
    lines = p.stdout + p.stderr
    assert re.search(r"format ok \d\.\d{3} masked", lines) and "search" not in lines
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 5
    assert (out / "final-model" / "config.json").is_file()
    # Batches were signed with per-worker keys and none was rejected.
    assert report["signed"] is True and report["rejected_by_reason"] == {}
    assert (out / "keys" / "w1.key").is_file() and (
        out / "store" / "trainer" / "keys.json"
    ).is_file()
    assert (out / "logs" / "trainer.log").is_file() and (out / "trainer.toml").is_file()

    # The report is rebuilt from the store alone, elsewhere.
    again = tmp_path / "again"
    p = subprocess.run(
        _cli("report", str(out / "store"), "--out", str(again)),
        env=_env(tmp_path), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    rebuilt = json.loads((again / "report.json").read_text())
    assert rebuilt == report


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_ctrl_c_or_sigterm_stops_every_child_and_still_reports(tmp_path, sig):
    """Ctrl-C: the trainer stops after its version and the final model is still
    exported and evaluated. SIGTERM: every process stops at once."""
    out = tmp_path / "run"
    cfg = _config(tmp_path, 200)
    cmd = _cli("run", "--preset", "smoke", "--config", str(cfg), "--out", str(out), "--no-live")
    launcher = subprocess.Popen(
        cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    t0 = time.monotonic()
    while _trainer_rows(out / "store") < 2:
        assert launcher.poll() is None, launcher.communicate()[1][-3000:]
        assert time.monotonic() - t0 < 300, "no versions within 300 s"
        time.sleep(0.3)
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 1, stderr[-3000:]
    assert "interrupted" in stderr
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "interrupted" and 2 <= report["versions_published"] < 200
    _no_child_left_and_a_checkpoint_at_the_end(out, report)
    graceful = sig == signal.SIGINT
    assert (out / "final-model" / "config.json").is_file() == graceful
    after = report["eval"].get("after")
    assert (after is not None and after["version"] == report["versions_published"]) == graceful


@pytest.mark.timeout(400)
def test_max_minutes_stops_training_and_still_exports_and_evaluates(tmp_path):
    out = tmp_path / "run"
    # Far more versions than 1.5 minutes make on any machine (the smoke run
    # once did 200 inside the budget): the budget is what stops it.
    cfg = _config(tmp_path, 100_000)
    cmd = _cli("run", "--preset", "smoke", "--config", str(cfg), "--out", str(out), "--no-live")
    env = {**_env(tmp_path), "COLONNADE_PROGRESS_SECONDS": "1"}
    p = subprocess.run(
        [*cmd, "--max-minutes", "1.5"], env=env, capture_output=True, text=True, timeout=380
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert "max_minutes spent" in p.stderr and "status: budget (max_minutes 1.5 spent)" in p.stdout
    assert "warm start: " in p.stderr and "eval before: " in p.stderr  # progress lines
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "budget" and 1 <= report["versions_published"] < 100_000
    assert report["eval"]["after"]["version"] == report["versions_published"]
    assert (out / "final-model" / "config.json").is_file()
    _no_child_left_and_a_checkpoint_at_the_end(out, report)


def _trainer_rows(root) -> int:
    """How many versions the trainer has reported so far (its segments are signed)."""
    if not (root / "run.json").is_file():
        return 0
    store = LocalStore(root)
    return len(trainer_rows(store, open_run(store).trust))


def _no_child_left_and_a_checkpoint_at_the_end(out, report) -> None:
    # No child is left: every pid the logs name is gone.
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    assert str(out / "trainer.toml") not in ps and str(out / "worker.toml") not in ps
    # The trainer stopped cleanly: a checkpoint at the version it reached.
    ckpts = sorted((out / "store" / "trainer" / "checkpoints").iterdir())
    assert int(ckpts[-1].name) == report["versions_published"]
