"""A mixed fleet: one MLX worker and one torch worker feed one trainer.

Processes over a LocalStore, smoke env. Both workers' batches are consumed;
the only trace of the engine is the batch's `engine` field (counted by the
trainer) and the heartbeat; the MLX worker follows PULSE patches like the
torch one, and the gate masks almost nothing of either.
"""

import os

import pytest

from colonnade.protocol import keys, latest_version
from colonnade.protocol.documents import ConsumedLedger, WorkerHeartbeat, read_document, read_signed
from colonnade.protocol.reader import open_run
from colonnade.store import LocalStore
from colonnade.telemetry import trainer_rows
from procs import spawn, wait_until

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

MAX_VERSIONS = 6


@pytest.mark.timeout(300)
def test_mlx_and_torch_workers_train_one_run(tmp_path, mlx_ready):
    root = tmp_path / "run"
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    trainer = spawn(
        [
            "trainer",
            "--store",
            str(root),
            "--preset",
            "smoke",
            "--max-versions",
            str(MAX_VERSIONS),
            "--retain-all",
        ],
        tmp_path / "trainer.log",
        env,
    )
    store = LocalStore(root)
    workers = []
    try:
        wait_until(lambda: store.exists(keys.RUN), 120, "run.json", [trainer])
        view = open_run(store)
        inbox, trust = view.inbox, view.trust
        # One at a time: the torch worker alone would finish the smoke run
        # before the MLX one has loaded. The MLX worker stops after 6 batches
        # (12 groups, half the run at most): it no longer finishes the run
        # alone either (it did once groups shared their prefill), so both
        # workers' batches are trained on whatever their speeds.
        for name, engine, extra in (("mac", "mlx", ["--max-batches", "6"]), ("pc", "torch", [])):
            workers.append(
                spawn(
                    [
                        "worker",
                        "--store",
                        str(root),
                        "--id",
                        name,
                        "--engine",
                        engine,
                        "--trust",
                        trust.fingerprint,
                        *extra,
                    ],
                    tmp_path / f"{name}.log",
                    env,
                )
            )
            heartbeat = keys.heartbeat_key(name)
            wait_until(lambda k=heartbeat: inbox.exists(k), 120, f"{name}'s first batch", workers)
        assert trainer.wait(timeout=240) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        for w in workers:
            assert w.wait(timeout=60) == 0
    finally:
        for p in (trainer, *workers):
            if p.poll() is None:
                p.kill()
    assert latest_version(store, trust) == MAX_VERSIONS
    consumed = [
        keys.parse_rollout_key(k)[1]
        for ledger in store.list(keys.CONSUMED)
        for k in read_signed(store, ledger, ConsumedLedger, trust).keys
    ]
    assert {"mac", "pc"} <= set(consumed)
    rows = trainer_rows(store, trust)
    assert sum(r.get("batches_from_mlx", 0) for r in rows[-1:]) > 0
    assert sum(r.get("batches_from_torch", 0) for r in rows[-1:]) > 0
    assert max(r["masked_fraction"] for r in rows) < 0.05
    mac = read_document(inbox, keys.heartbeat_key("mac"), WorkerHeartbeat)
    pc = read_document(inbox, keys.heartbeat_key("pc"), WorkerHeartbeat)
    assert mac.engine == "mlx-int8" and pc.engine == "int8-w8"
    assert mac.version >= 1 and mac.batches >= 1
    assert "now running v" in (tmp_path / "mac.log").read_text()
