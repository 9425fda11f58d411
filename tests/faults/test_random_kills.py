"""SIGKILL at random moments, over seeds: trainer and workers die and come back.

Per seed, a trainer and two workers run as processes over a local store
(smoke preset). A chaos loop SIGKILLs a random one of them at random
intervals, so kills land mid-generation, mid-upload, mid-patch-apply,
mid-step and mid-publish as chance has it, and restarts it (the trainer with
--takeover). Then the run is left to finish, and the invariants are checked:
every version 0..N exists once and rebuilds to its hash, no batch was
consumed twice or outside max_lag, and no object in the store is partial
(every rollout in the inbox decodes; every checkpoint that counts is
complete and signed). The trainer comes back with the key it made at the
first start (kept in the cache for this store); restarted workers pin it
again from run.json.
"""

import json
import random
import signal
import time

import pytest

from colonnade.launch.processes import spawn
from colonnade.protocol import decode_batch, keys, latest_version
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import strip_unsigned
from colonnade.store import LocalStore
from colonnade.train.checkpoint import checkpoints, read_state
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
    view = open_run(store)
    trust = view.trust
    for w in ("w1", "w2"):
        procs[w] = spawn(w, ["worker", "--store", str(root), "--id", w], logs, 1)
    killed = []
    try:
        while len(killed) < KILLS and (latest_version(store, trust) or 0) < VERSIONS - 2:
            time.sleep(rng.uniform(0.5, 3.0))
            name = rng.choice(sorted(procs))
            procs[name].proc.send_signal(signal.SIGKILL)
            procs[name].proc.wait()
            killed.append((name, latest_version(store, trust)))
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

    assert latest_version(store, trust) == VERSIONS
    # The trainer that came back signed with the run's key: everything verifies.
    assert open_run(store, trust.fingerprint).trust == trust
    check_versions(store, VERSIONS, ANCHOR, trust)
    check_consumed(store, MAX_LAG, trust)
    # No partial object: every rollout decodes, every listed checkpoint is complete.
    listing = list_inbox(view.inbox)
    assert not listing.junk and not listing.beyond
    rollouts = [k for found in listing.rollouts.values() for k in found]
    assert rollouts
    for key in rollouts:
        decode_batch(strip_unsigned(view.inbox.get(key)), 1 << 20, 1 << 16)
    found = checkpoints(store)
    assert found
    for v in found:
        assert read_state(store, v, trust)["version"] == v
