"""`colonnade run` with a served environment, its tool service killed and
restarted while the run trains: the workers wait for it, and the run
finishes with every version and no group refused."""

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from colonnade.protocol import keys
from colonnade.protocol.signing import new_keypair
from toolproc import TESTS, ServiceProcess

pytestmark = [pytest.mark.procs, pytest.mark.slow]
VERSIONS = 5


@pytest.mark.timeout(600)
def test_a_run_waits_out_its_tool_service_and_trains_every_group(tmp_path):
    key, _ = new_keypair("tools", tmp_path / "keys")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    svc = ServiceProcess("served_env", ["max_turns=3"], key, port).start()
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "eval_n = 8\nwarmstart = false\n"
        f"[trainer]\nmax_versions = {VERSIONS}\ncheckpoint_every = 100\n"
        "group_size = 4\ngroups_per_step = 4\nmax_turn_tokens = 12\nmax_episode_tokens = 64\n"
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "colonnade.cli.main", "run", "--preset", "smoke",
           "--env", "served_env", "--env-arg", f"service={svc.url}",
           "--env-arg", f"service_key={svc.key}", "--config", str(cfg), "--out", str(out),
           "--no-live"]  # fmt: skip
    path = os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": path}  # fmt: skip
    said = (tmp_path / "run.out").open("w")
    run = subprocess.Popen(cmd, env=env, stdout=said, stderr=subprocess.STDOUT)
    try:
        # Kill the service for good measure once the run has trained twice.
        second = out / "store" / keys.weights_dir(2) / "meta.json"
        t0 = time.monotonic()
        while not second.exists() and run.poll() is None and time.monotonic() - t0 < 400:
            time.sleep(0.2)
        assert second.exists(), "the run did not reach v2"
        svc.kill()
        time.sleep(3.0)
        svc.start()
        run.wait(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
        svc.kill()
    said.close()
    assert run.returncode == 0, (tmp_path / "run.out").read_text()[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["versions_published"] == VERSIONS and report["rejected_by_reason"] == {}
    assert report["groups_rejected"] == 0 and report["rollouts_rejected"] == 0
    assert report["episodes_consumed"] >= VERSIONS * 4 * 4  # every step's groups, whole
    logs = "".join((out / "logs" / f"worker-{i}.log").read_text() for i in (1, 2))
    assert "again in" in logs  # the workers backed off while it was down, and went on
    assert "episode ended" not in logs  # no episode gave up on it
