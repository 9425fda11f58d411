"""Trainer and two workers as separate OS processes over a LocalStore.

One run, smoke env: the trainer is killed with SIGKILL mid-run and
restarted; afterwards every version 0..N exists exactly once and rebuilds to
its hash on a fresh follower, no rollout batch was consumed twice, and every
consumed batch was within max_lag of the version it trained. The trainer
signs with a key made ahead (`--key`), which the workers trust (`--trust`);
the restarted trainer signs with it too. Once with full fine-tuning, once
with LoRA (the workers run the adapters unmerged; checkpoints hold them alone).
"""

import os
import signal

import pytest

from colonnade import pulse
from colonnade.protocol import Follower, keys, latest_version
from colonnade.protocol.documents import WorkerHeartbeat, read_document
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import new_keypair, trusted_fingerprint
from colonnade.pulse.quant import is_adapter
from colonnade.store import LocalStore
from colonnade.telemetry import trainer_rows
from procs import spawn, wait_until
from run_checks import check_consumed, check_versions

pytestmark = pytest.mark.procs  # separate processes: not in the fast lane

MAX_VERSIONS = 7
MAX_LAG = 1


@pytest.mark.timeout(420)
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_run_survives_a_trainer_kill(tmp_path, lora):
    root = tmp_path / "run"
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    key, pub = new_keypair("trainer", tmp_path / "keys")
    trainer_args = [
        "trainer",
        "--store",
        str(root),
        "--preset",
        "smoke",
        "--max-versions",
        str(MAX_VERSIONS),
        "--max-lag",
        str(MAX_LAG),
        "--checkpoint-every",
        "2",
        "--anchor-every",
        "3",
        "--retain-all",
        "--key",
        str(key),
        *(["--lora-rank", "8"] if lora else []),
    ]
    trainer = spawn(trainer_args, tmp_path / "trainer1.log", env)
    store = LocalStore(root)
    workers = []
    try:
        wait_until(lambda: store.exists(keys.RUN), 120, "run.json", [trainer])
        view = open_run(store, trusted_fingerprint(str(pub)))  # signed with the key given
        trust = view.trust
        workers = [
            spawn(
                ["worker", "--store", str(root), "--id", f"w{i}", "--trust", str(pub)],
                tmp_path / f"w{i}.log",
                env,
            )
            for i in (1, 2)
        ]
        wait_until(lambda: (latest_version(store, trust) or 0) >= 3, 180, "v3", [trainer, *workers])
        trainer.send_signal(signal.SIGKILL)
        trainer.wait()
        killed_at = latest_version(store, trust)
        trainer = spawn([*trainer_args, "--takeover"], tmp_path / "trainer2.log", env)
        assert trainer.wait(timeout=240) == 0, (tmp_path / "trainer2.log").read_text()[-3000:]
        for w in workers:
            assert w.wait(timeout=60) == 0  # they see done.json and exit cleanly
    finally:
        for p in (trainer, *workers):
            if p.poll() is None:
                p.kill()
    log2 = (tmp_path / "trainer2.log").read_text()
    assert "resumed run" in log2
    assert latest_version(store, trust) == MAX_VERSIONS > killed_at

    metas = check_versions(store, MAX_VERSIONS, anchor_every=3, trust=trust)
    assert [m.kind for m in metas] == [
        "full" if v % 3 == 0 else "patch" for v in range(MAX_VERSIONS + 1)
    ]
    check_consumed(store, MAX_LAG, trust)
    rows = trainer_rows(store, trust)
    assert {r["version"] for r in rows} >= set(range(killed_at + 1, MAX_VERSIONS + 1))
    for r in rows:
        assert r["episodes"] >= 4 * 4 and set(r) >= {
            "loss",
            "masked_fraction",
            "staleness",
            "patch_bytes",
            "wait_seconds",
        }
    hb = read_document(view.inbox, keys.heartbeat_key("w1"), WorkerHeartbeat)
    assert hb.engine.startswith("int8") and hb.batches >= 1
    # Workers wrote only to the inbox; nothing of theirs is in the run's own folders.
    assert not store.list(keys.CLAIMS) and not store.list("rollouts/")
    assert all(k.startswith((keys.INBOX, "weights/", "trainer/", "model/", "metrics/trainer-main/"))
               or k == keys.RUN for k in store.list(""))  # fmt: skip
    if lora:
        # v0 carries the adapters beside the base; no later version touched
        # the base, across the kill (the resumed trainer kept the one it had
        # published). (An untrained tiny model's groups all score 0 here, so
        # the adapters may not move either: tests/rollout covers that.)
        state = Follower(store, 3, trust)
        state.sync(0)
        assert any(is_adapter(k) for k in state.state)
        for v in range(1, MAX_VERSIONS + 1):
            header = pulse.read_header(store.get(keys.patch_key(v)))
            names = [e["name"] for e in header["tensors"]]
            assert all(is_adapter(n) for n in names), (v, names[:3])
