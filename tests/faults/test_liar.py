"""A worker forging log-probs beside an honest one: quarantined, the run goes on.

Trainer, an honest worker and a lying worker run as separate processes over
a local store (smoke preset). The liar's rewards are recomputed like anyone's,
but its claimed log-probs do not fit the policy: its mismatch KL stands far
above the honest worker's, it is quarantined, and its later batches are
refused while the honest worker's keep training.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from colonnade.protocol import keys
from colonnade.protocol.documents import Quarantine, read_signed
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import new_keypair, trusted_fingerprint
from colonnade.store import LocalStore
from colonnade.telemetry import trainer_rows

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

HERE = Path(__file__).parent


def _wait_for_line(tmp_path, names, line: str, procs, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not all(line in (tmp_path / f"{n}.log").read_text() for n in names):
        assert time.monotonic() < deadline, f"no {line!r} in every log of {names}"
        assert all(p.poll() is None for p in procs), "a worker exited before the run began"
        time.sleep(0.2)


@pytest.mark.timeout(300)
def test_a_lying_worker_is_quarantined(tmp_path):
    root = tmp_path / "run"
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "colonnade.cli.main"]
    # A warm start, so groups have mixed rewards: flat groups train nothing and
    # carry no gate figures (nor any harm).
    model = subprocess.run(
        [*cli, "warmstart", "--env", "smoke", "--steps", "200", "--drill-steps", "0",
         "--good-fraction", "0.3"],
        env=env, capture_output=True, text=True, check=True, timeout=200,
    ).stdout.strip()  # fmt: skip
    # The trainer's key, made ahead: the workers trust it before the run exists.
    key, pub = new_keypair("trainer", tmp_path / "keys")
    cfg = tmp_path / "trainer.toml"
    # Ten versions: the decision usually comes at v5, and once came at v8 (a
    # slow start), which left no version after it to check.
    # No spot checks: they would catch this liar too (every row it sends is
    # a proof), and this test is about the mismatch statistics
    # (the spot checks are tested in tests/train/test_spot.py).
    cfg.write_text(
        f'store = "{root}"\nmodel = "{model}"\nmax_versions = 10\nquarantine_min_tokens = 50\n'
        f'key = "{key}"\nspot_rate = 0.0\n'
    )
    logs = {n: (tmp_path / f"{n}.log").open("w") for n in ("trainer", "honest", "liar")}
    trusting = ["--trust", str(pub)]
    procs = [
        subprocess.Popen([*cli, "worker", "--store", str(root), "--id", "honest", *trusting],
                         env=env, stdout=logs["honest"], stderr=subprocess.STDOUT),
        subprocess.Popen([sys.executable, str(HERE / "liar_worker.py"), "--store", str(root),
                          "--id", "liar", *trusting],
                         env=env, stdout=logs["liar"], stderr=subprocess.STDOUT),
    ]  # fmt: skip
    # Both workers wait for the run before it starts: the fleet makes what the
    # trainer asks for, so a worker still starting up (seconds on a loaded
    # machine) would find a run of 10 short versions already over.
    _wait_for_line(tmp_path, ("honest", "liar"), "waiting for run.json", procs)
    trainer = [*cli, "trainer", "--config", str(cfg), "--preset", "smoke"]
    procs.insert(
        0, subprocess.Popen(trainer, env=env, stdout=logs["trainer"], stderr=subprocess.STDOUT)
    )
    try:
        assert procs[0].wait(timeout=280) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        liar_exit = procs[2].poll()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    store = LocalStore(root)
    trust = open_run(store, trusted_fingerprint(str(pub))).trust  # the key given
    assert store.exists(keys.QUARANTINE), (tmp_path / "trainer.log").read_text()[-3000:]
    quarantine = read_signed(store, keys.QUARANTINE, Quarantine, trust).decisions
    assert list(quarantine) == ["liar"], quarantine
    assert "mismatch KL" in quarantine["liar"].reason
    rows = trainer_rows(store, trust)
    assert rows[-1]["version"] == 10
    after = [r for r in rows if r["version"] > quarantine["liar"].version]
    assert after and all("liar" not in r["gate_by_worker"] for r in after)
    # Its batches that came after the decision were refused; once it synced a
    # newer version it read the decision and stopped, saying why.
    liar_log = (tmp_path / "liar.log").read_text()
    refused = rows[-1]["per_worker"]["liar"].get("rejected_quarantined", 0)
    assert refused >= 1 or "quarantined worker liar" in liar_log
    if liar_exit is not None:
        assert liar_exit != 0 and "quarantined worker liar" in liar_log, liar_log[-2000:]
