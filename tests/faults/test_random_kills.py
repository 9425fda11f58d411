"""SIGKILL at random moments, over seeds: trainer and workers die and come back.

Per seed, a trainer and two workers run as processes over a local store
(smoke preset). A chaos loop SIGKILLs a random one of them at random
intervals, so kills land mid-generation, mid-upload, mid-patch-apply,
mid-step and mid-publish as chance has it, and restarts it (the trainer with
--takeover). Then the run is left to finish, and the invariants are checked:
every version 0..N exists once and rebuilds to its hash, no batch was
consumed twice or outside max_lag, and no object in the store is partial
(every rollout decodes; every checkpoint that counts is complete).
"""

import json
import random
import signal
import time

import pytest

from colonnade.launch.processes import spawn
from colonnade.protocol import decode_batch, keys, latest_version
from colonnade.protocol.signing import strip_unsigned
from colonnade.store import LocalStore
from run_checks import check_consumed, check_versions

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

VERSIONS, MAX_LAG, ANCHOR = 8, 1, 4
KILLS = 4


def _trainer_args(root, takeover):
    args = ["trainer", "--store", str(root), "--preset", "smoke", "--max-versions",
            str(VERSIONS), "--retain-all", "--max-lag", str(MAX_LAG), "--checkpoint-every", "2",
            "--anchor-every", str(ANCHOR)]  # fmt: skip
    return [*args, "--takeover"] if takeover else args


@pytest.mark.timeout(600)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_sigkills_leave_a_consistent_run(tmp_path, seed, monkeypatch):
    monkeypatch.setenv("COLONNADE_CACHE", str(tmp_path / "cache"))
    rng = random.Random(seed)
    root, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    store = LocalStore(root)
    procs = {"trainer": spawn("trainer", _trainer_args(root, False), logs, 1)}
    deadline = time.monotonic() + 240
    while not store.exists(keys.RUN):
        assert time.monotonic() < deadline, (logs / "trainer.log").read_text()[-2000:]
        time.sleep(0.2)
    for w in ("w1", "w2"):
        procs[w] = spawn(w, ["worker", "--store", str(root), "--id", w], logs, 1)
    killed = []
    try:
        while len(killed) < KILLS and (latest_version(store) or 0) < VERSIONS - 2:
            time.sleep(rng.uniform(0.5, 3.0))
            name = rng.choice(sorted(procs))
            procs[name].proc.send_signal(signal.SIGKILL)
            procs[name].proc.wait()
            killed.append((name, latest_version(store)))
            args = _trainer_args(root, True) if name == "trainer" else [
                "worker", "--store", str(root), "--id", name]  # fmt: skip
            procs[name] = spawn(name, args, logs, 1)
        assert procs["trainer"].proc.wait(timeout=400) == 0, procs["trainer"].tail(40)
        for w in ("w1", "w2"):
            assert procs[w].proc.wait(timeout=60) == 0, procs[w].tail(40)
    finally:
        for c in procs.values():
            if c.alive:
                c.proc.kill()
                c.proc.wait()
    assert len(killed) >= 1
    (tmp_path / "kills.json").write_text(json.dumps(killed))

    assert latest_version(store) == VERSIONS
    check_versions(store, VERSIONS, ANCHOR)
    check_consumed(store, MAX_LAG)
    # No partial object: every rollout decodes, every listed checkpoint is complete.
    for key in store.list("rollouts/"):
        decode_batch(strip_unsigned(store.get(key)), 1 << 20, 1 << 16)
    for key in store.list("trainer/checkpoints/"):
        if key.endswith("state.json"):
            assert json.loads(store.get(key))
