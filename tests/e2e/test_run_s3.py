"""Trainer + 2 workers as separate processes over the real local S3 server.

`colonnade run --store s3://…` starts the same `colonnade trainer` and
`colonnade worker` processes a user starts on separate machines; they share
nothing but the bucket. Afterwards every version rebuilds to its hash from
S3 alone (checked against the trainer key `colonnade run` made), and
`colonnade report s3://…` rebuilds the report.
"""

import json
import os
import subprocess
import sys
import uuid

import pytest

from colonnade.protocol import Follower, keys, latest_version, read_meta
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import trusted_fingerprint
from colonnade.store import open_store

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane


@pytest.mark.s3
@pytest.mark.timeout(400)
def test_run_over_s3(tmp_path, seaweed, monkeypatch):
    env = {
        **os.environ,
        **seaweed.env(),
        "COLONNADE_CACHE": str(tmp_path / "cache"),
        "OMP_NUM_THREADS": "1",
    }
    url = f"s3://{seaweed.bucket}/run-{uuid.uuid4().hex[:8]}"
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        "warmstart_steps = 20\neval_n = 8\n[trainer]\nmax_versions = 4\nretain_all = true\n"
    )
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "colonnade.cli.main", "run", "--preset", "smoke"]
    cmd += ["--config", str(cfg), "--out", str(out), "--no-live"]
    cmd += ["--store", url, "--endpoint-url", seaweed.endpoint]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=380)
    assert p.returncode == 0, p.stderr[-3000:]
    assert not (out / "store").exists()  # everything went to the bucket

    for k, v in seaweed.env().items():
        monkeypatch.setenv(k, v)
    store = open_store(url, endpoint_url=seaweed.endpoint)
    fingerprint = trusted_fingerprint(str(out / "trainer-key" / "trainer.pub"))
    view = open_run(store, fingerprint)
    trust = view.trust
    assert latest_version(store, trust) == 4
    f = Follower(store, anchor_every=10, trust=trust)
    for v in range(5):
        f.sync(v)
        assert f.state_hash == read_meta(store, v, trust).state_hash
    # The workers wrote to the inbox folder of the bucket's run prefix.
    assert {keys.inbox_owner(k) for k in view.inbox.list("")} >= {"w1", "w2"}
    report = json.loads((out / "report.json").read_text())
    assert report["trainer_key"] == fingerprint
    assert report["status"] == "finished" and set(report["workers"]) == {"w1", "w2"}
    assert report["rollouts_consumed"] >= 8 and report["eval"]["after"]["version"] == 4

    p = subprocess.run(
        [sys.executable, "-m", "colonnade.cli.main", "report", url,
         "--endpoint-url", seaweed.endpoint, "--out", str(tmp_path / "again")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((tmp_path / "again" / "report.json").read_text()) == report
