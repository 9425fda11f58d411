"""A trainer and a pipeline group of two stage-workers as separate OS
processes over a LocalStore, the group the run's only worker.

`colonnade worker --stage 1/2` and `--stage 2/2` (the same --stage-group)
make every batch the trainer trains on, across versions and anchors, so
both stages follow the versions and the later stage catches up to the one
each step names. The trainer checks every row's log-probs against its own
(spot rate 1, the tiny model's tight tolerances): the pipeline's μ is the
published weights'. Stage 2 is killed mid-run: the front gives its batch
up (nothing of it is uploaded) and goes on once stage 2 is back. Twice:
the messages through the inbox in an open run, and over TCP links
(`--stage-link tcp`) in a signed run, where each stage takes only the
registered key's messages and stage 2 comes back on another port.

And the smoke preset learns through a group: `colonnade run` with
`stages = 2`, the group its only worker.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from colonnade.protocol import keys, latest_version
from colonnade.protocol.documents import WorkerHeartbeat, read_document
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import new_keypair, trusted_fingerprint
from colonnade.store import LocalStore
from colonnade.telemetry import trainer_rows
from procs import spawn, wait_until
from run_checks import check_consumed, check_versions

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

MAX_VERSIONS = 5
KILL_AT = 2  # the version after which stage 2 is killed
GROUP = "front,back"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("link", ["store", "tcp"])
def test_a_two_stage_group_makes_the_runs_batches_and_survives_a_stage_kill(tmp_path, link):
    root = tmp_path / "run"
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    key, pub = new_keypair("trainer", tmp_path / "keys")
    signed = []  # the tcp run is a signed one: each stage signs what it sends
    if link == "tcp":
        for worker in GROUP.split(","):
            new_keypair(worker, tmp_path / "workers")
        signed = ["--worker-keys", str(tmp_path / "workers")]
    trainer = spawn(
        ["trainer", "--store", str(root), "--preset", "smoke", "--key", str(key),
         "--max-versions", str(MAX_VERSIONS), "--anchor-every", "2", "--retain-all",
         "--spot-rate", "1", "--spot-logp-tolerance", "0.06",
         "--spot-interval-tolerance", "0.025", *signed],
        tmp_path / "trainer.log", env, append=True,
    )  # fmt: skip
    store = LocalStore(root)
    logs = {k: tmp_path / f"stage{k}.log" for k in (1, 2)}

    def stage(k: int):
        me = GROUP.split(",")[k - 1]
        worker = ["worker", "--store", str(root), "--trust", str(pub), "--id", me,
                  "--stage", f"{k}/2", "--stage-group", GROUP, "--stage-timeout", "10"]  # fmt: skip
        if link == "tcp":
            worker += ["--stage-link", "tcp", "--stage-listen", "127.0.0.1:0",
                       "--key", str(tmp_path / "workers" / f"{me}.key")]  # fmt: skip
        return spawn(worker, logs[k], env, append=True)

    stages = {}
    try:
        wait_until(lambda: store.exists(keys.RUN), 120, "run.json", [trainer])
        trust = open_run(store, trusted_fingerprint(str(pub))).trust
        stages = {1: stage(1), 2: stage(2)}
        procs = [trainer, *stages.values()]
        wait_until(
            lambda: (latest_version(store, trust) or 0) >= KILL_AT, 300, f"v{KILL_AT}", procs
        )
        stages[2].send_signal(signal.SIGKILL)
        stages[2].wait()
        # The front waits out its timeout and gives the batch up.
        wait_until(lambda: "batch given up" in logs[1].read_text(), 120, "a batch given up",
                   [trainer, stages[1]])  # fmt: skip
        given_up_at = latest_version(store, trust)
        stages[2] = stage(2)
        assert trainer.wait(timeout=400) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        for k, p in stages.items():  # they see the run's end and exit cleanly
            assert p.wait(timeout=60) == 0, logs[k].read_text()[-3000:]
    finally:
        for p in (trainer, *stages.values()):
            if p.poll() is None:
                p.kill()
    assert latest_version(store, trust) == MAX_VERSIONS > given_up_at
    check_versions(store, MAX_VERSIONS, anchor_every=2, trust=trust)
    consumed = check_consumed(store, 2, trust)
    # Every trained batch is the group's, uploaded by its first stage, over
    # every version; the later stage uploaded nothing.
    made = [keys.parse_rollout_key(k) for k in consumed]
    assert {w for _, w, _ in made} == {"front"}
    assert len({v for v, _, _ in made}) >= 3
    view = open_run(store, trusted_fingerprint(str(pub)))
    assert not [k for k in view.inbox.list(keys.worker_dir("back")) if keys.parse_rollout_key(k)]
    # Every row of every trained batch was checked against the trainer's own
    # log-probs of its version, and none was refused.
    rows = trainer_rows(store, trust)
    assert {r["version"] for r in rows} == set(range(1, MAX_VERSIONS + 1))
    assert sum(r["rejected"] for r in rows) == 0
    assert all(r["spot_rows"] == r["episodes"] for r in rows)
    assert not store.exists(keys.QUARANTINE)
    # The later stage caught up to the versions its steps named, both runs of it.
    back = logs[2].read_text()
    assert back.count("stage ready at v") == 2 and "now running v" in back
    front = read_document(view.inbox, keys.heartbeat_key("front"), WorkerHeartbeat)
    assert front.engine.endswith("-stage1of2") and front.batches >= MAX_VERSIONS
    if link == "tcp":  # no message went through the inbox; the stages' addresses did
        assert not [k for k in view.inbox.list("") if keys.parse_stage_key(k)]
        assert view.inbox.exists(keys.stage_link_key("back"))
        assert back.count("stage link: listening on 127.0.0.1") == 2


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_smoke_run_learns_through_a_two_stage_group(tmp_path):
    # test_run.py's learning run (12 versions, the preset's warm start, 32
    # held-out tasks) with its two workers as one group of two stages.
    out, cfg = tmp_path / "run", tmp_path / "run.toml"
    cfg.write_text("stages = 2\nwarmstart_steps = 300\neval_n = 32\n"
                   "[trainer]\nmax_versions = 12\ncheckpoint_every = 100\n")  # fmt: skip
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "colonnade.cli.main", "run", "--preset", "smoke",
           "--config", str(cfg), "--out", str(out), "--no-live"]  # fmt: skip
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=580)
    assert p.returncode == 0, p.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["status"] == "finished" and report["versions_published"] == 12
    before, after = report["eval"]["before"], report["eval"]["after"]
    # As test_run.py's whole workers: +0.3 at least (measured there +0.56 to +0.59).
    assert after["pass_at_1"] >= before["pass_at_1"] + 0.3, (before, after)
    # Every batch came from the group's first stage; none was refused.
    assert set(report["workers"]) == {"w1"}
    assert report["workers"]["w1"]["engine"].endswith("-stage1of2")
    assert report["rollouts_consumed"] >= 12 * 4 and report["rejected_by_reason"] == {}
