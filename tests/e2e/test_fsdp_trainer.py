"""The trainer on 2 ranks under torchrun (FSDP2, gloo on the CPU), end to end.

- `colonnade run --trainer-ranks 2` on the smoke preset learns;
- a rank killed with SIGKILL ends the whole job within DEADLINE seconds (no
  rank left hanging in a collective), and a restart on 2 ranks resumes from
  the sharded checkpoint; every version then exists once and rebuilds to its
  hash on a fresh follower, no batch was consumed twice;
- a checkpoint written by 2 ranks loads into 1 (DCP reshards).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colonnade.protocol import keys, latest_version
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import new_keypair, trusted_fingerprint
from colonnade.store import LocalStore
from colonnade.train.checkpoint import read_state
from procs import wait_until
from run_checks import check_consumed, check_versions

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

DEADLINE = 60  # seconds from a rank's SIGKILL to the end of the job
SMOKE_WARMSTART = {"model": "tiny", "env": "smoke", "good_fraction": 0.3, "steps": 300}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding the smoke preset's warm start (shared by the tests here)."""
    from colonnade.train.warmstart import WarmstartConfig, warmstart

    root = tmp_path_factory.mktemp("cache")
    old = os.environ.get("COLONNADE_CACHE")
    os.environ["COLONNADE_CACHE"] = str(root)
    try:
        path, _ = warmstart(WarmstartConfig(**SMOKE_WARMSTART))
    finally:
        if old is None:
            del os.environ["COLONNADE_CACHE"]
        else:
            os.environ["COLONNADE_CACHE"] = old
    return root, path


def _env(cache_root):
    return {**os.environ, "COLONNADE_CACHE": str(cache_root), "OMP_NUM_THREADS": "1"}


def _torchrun(args, log: Path, env):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "-m", "colonnade", *args]  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "State:\tZ" in status.read_text())


@pytest.mark.timeout(600)
def test_run_with_two_trainer_ranks_learns(cache, tmp_path):
    cache_root, _ = cache
    out = tmp_path / "run"
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "eval_n = 64\n[trainer]\nmax_versions = 16\ncheckpoint_every = 8\nretain_all = true\n"
    )
    cmd = [sys.executable, "-m", "colonnade", "run", "--preset", "smoke", "--config", str(cfg),
           "--trainer-ranks", "2", "--workers", "1", "--out", str(out), "--no-live"]  # fmt: skip
    p = subprocess.run(cmd, env=_env(cache_root), capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    log = (out / "logs" / "trainer.log").read_text()
    assert "rank 1 of 2 on cpu (gloo)" in log and "2 rank(s)" in log
    report = json.loads((out / "report.json").read_text())
    before, after = report["eval"]["before"], report["eval"]["after"]
    assert report["status"] == "finished" and after["version"] == 16
    assert after["pass_at_1"] >= before["pass_at_1"] + 0.3, (before, after)
    store = LocalStore(out / "store")
    trust = open_run(store, trusted_fingerprint(str(out / "trainer-key" / "trainer.pub"))).trust
    check_versions(store, 16, anchor_every=10, trust=trust)
    check_consumed(store, max_lag=2, trust=trust)


@pytest.mark.timeout(600)
def test_a_killed_rank_ends_the_job_and_a_restart_resumes(cache, tmp_path):
    cache_root, model = cache
    env = _env(cache_root)
    root = tmp_path / "store"
    key, pub = new_keypair("trainer", tmp_path / "keys")
    args = ["trainer", "--store", str(root), "--preset", "smoke", "--model", str(model),
            "--device", "cpu", "--max-versions", "10", "--max-lag", "1", "--checkpoint-every",
            "2", "--anchor-every", "3", "--retain-all", "--key", str(key)]  # fmt: skip
    store = LocalStore(root)
    job = _torchrun(args, tmp_path / "job1.log", env)
    worker = None
    try:
        wait_until(lambda: store.exists(keys.RUN), 120, "run.json", [job])
        trust = open_run(store, trusted_fingerprint(str(pub))).trust
        worker = subprocess.Popen(
            [sys.executable, "-m", "colonnade", "worker", "--store", str(root), "--id", "w1",
             "--trust", str(pub)],
            stdout=(tmp_path / "w1.log").open("w"), stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        wait_until(lambda: (latest_version(store, trust) or 0) >= 4, 240, "v4", [job, worker])
        pids = dict(re.findall(r"rank (\d) of 2 on cpu \(gloo\), pid (\d+)",
                               (tmp_path / "job1.log").read_text()))  # fmt: skip
        os.kill(int(pids["1"]), signal.SIGKILL)
        t0 = time.monotonic()
        rc = job.wait(timeout=DEADLINE + 30)
        ended = time.monotonic() - t0
        print(f"job ended {ended:.1f} s after the SIGKILL of rank 1 (rc {rc})")
        assert rc != 0 and ended < DEADLINE, f"the job took {ended:.0f} s to end (rc {rc})"
        assert not _alive(int(pids["0"])), "rank 0 outlived the job"
        killed_at = latest_version(store, trust)
        job = _torchrun([*args, "--takeover"], tmp_path / "job2.log", env)
        assert job.wait(timeout=400) == 0, (tmp_path / "job2.log").read_text()[-3000:]
        assert worker.wait(timeout=60) == 0  # it sees done.json and exits
    finally:
        for p in (job, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert "resumed run" in (tmp_path / "job2.log").read_text()
    assert latest_version(store, trust) == 10 > killed_at
    check_versions(store, 10, anchor_every=3, trust=trust)
    check_consumed(store, max_lag=1, trust=trust)
    state = read_state(store, 10, trust)  # signed by the trainer's rank 0
    assert state["ranks"] == 2 and len(state["shards"]) == 2

    # The same checkpoint resumes on one rank: DCP reshards it.
    one = subprocess.run(
        [sys.executable, "-m", "colonnade", *args, "--takeover"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert "resharded to 1" in one.stderr and "resumed run" in one.stderr, one.stderr[-3000:]
