"""Several processes race on put_if_absent: exactly one wins, its bytes stay.

The start is a barrier: each process imports, opens the store, says it is
ready and waits for the go file; the go file appears once all have said so.
"""

import json
import subprocess
import sys
import uuid

import pytest

from colonnade.store import LocalStore
from s3server import make_s3_store

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

N = 12
SCRIPT = r"""
import os, sys, time, json
from colonnade.store import open_store
url, endpoint, key, go, me = sys.argv[1:6]
store = open_store(url, endpoint_url=endpoint or None)
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.001)
won = store.put_if_absent(key, f"writer-{me}".encode())
print(json.dumps({"me": me, "won": won}))
"""


def _race(tmp_path, url: str, endpoint: str, read) -> None:
    key = f"race/{uuid.uuid4().hex}/meta.json"
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", SCRIPT, url, endpoint, key, str(go), str(i)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(N)
    ]
    ready = [p.stdout.readline() for p in procs]  # blocks until each has reached the barrier
    assert ready == ["ready\n"] * N, ready  # "": that process died before it
    go.touch()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    winners = [r["me"] for r in results if r["won"]]
    assert len(winners) == 1, results
    assert read(key) == f"writer-{winners[0]}".encode()


def test_local_race(tmp_path):
    root = tmp_path / "store"
    store = LocalStore(root)
    _race(tmp_path, str(root), "", store.get)


@pytest.mark.s3
def test_s3_race(tmp_path, s3_env):
    store = make_s3_store(s3_env)
    _race(tmp_path, f"s3://{store.bucket}/{store.prefix}", s3_env.endpoint, store.get)
