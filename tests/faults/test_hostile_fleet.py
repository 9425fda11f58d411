"""A fleet you need not trust: real trainer and worker processes on a local
store, a hostile process writing wherever a worker's shared credentials
would let it (tests/faults/hostile_writer.py), and a trainer SIGKILLed and
restarted amid planted junk.

The run must end as a clean one does: every version published and
rebuilding to the hash the trainer signed, the honest workers working to the
end and never quarantined, no worker running a version the trainer did not
sign, and the trainer's peak memory within 300 MB of a clean run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade import pulse
from colonnade.protocol import Follower, keys, latest_version, read_meta
from colonnade.protocol.documents import Done, Quarantine, read_signed
from colonnade.protocol.reader import open_run
from colonnade.protocol.schemas import SchemaError
from colonnade.protocol.signing import Signer, fingerprint, load_public, new_keypair
from colonnade.store import LocalStore
from colonnade.telemetry import read_trainer_rows, read_worker_rows
from procs import spawn, wait_until

pytestmark = [pytest.mark.procs, pytest.mark.slow]

MAX_VERSIONS = 16
HERE = Path(__file__).parent


def _run(tmp: Path, hostile: bool) -> dict:
    """One run of the smoke preset with two honest workers; with `hostile`,
    the attacker writes throughout and the trainer is killed and restarted."""
    root, keydir, tkey = tmp / "run", tmp / "keys", tmp / "trainer-key"
    env = {
        **os.environ,
        "COLONNADE_CACHE": str(tmp / "cache"),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    for w in ("w1", "w2", "w3"):  # w3: registered, held by the attacker
        new_keypair(w, keydir)
    new_keypair("trainer", tkey)
    trainer_args = [
        "trainer",
        "--store",
        str(root),
        "--preset",
        "smoke",
        "--max-versions",
        str(MAX_VERSIONS),
        "--max-lag",
        "1",
        "--checkpoint-every",
        "2",
        "--anchor-every",
        "3",
        "--key",
        str(tkey / "trainer.key"),
        "--worker-keys",
        str(keydir),
    ]
    store = LocalStore(root)
    trust = fingerprint(load_public(tkey / "trainer.pub")[1])
    logs = {"trainer": tmp / "trainer1.log"}
    trainer = spawn(trainer_args, logs["trainer"], env)
    procs, attacker, workers = [trainer], None, []
    stop = tmp / "stop-attacking"
    try:
        wait_until(lambda: store.exists(keys.RUN), 120, "run.json", [trainer])
        if hostile:
            attacker = spawn(
                [str(root), str(keydir), str(stop)],
                tmp / "attacker.log",
                env,
                script=str(HERE / "hostile_writer.py"),
            )
            _tamper_before_join(store)
            # The flood lands before the workers join: the trainer meets it at once.
            flooded = lambda: "junk objects" in (tmp / "attacker.log").read_text()  # noqa: E731
            wait_until(flooded, 300, "the flood", [trainer, attacker])
        for w in ("w1", "w2"):
            args = [
                "worker",
                "--store",
                str(root),
                "--id",
                w,
                "--key",
                str(keydir / f"{w}.key"),
                "--trust",
                str(tkey / "trainer.pub"),
            ]
            logs[w] = tmp / f"{w}.log"
            workers.append(spawn(args, logs[w], env))
        view = open_run(store, trust)
        if hostile:
            half = MAX_VERSIONS // 2
            wait_until(
                lambda: (latest_version(store, view.trust) or 0) >= half,
                300,
                "half the run",
                [trainer, *workers],
            )
            trainer.send_signal(signal.SIGKILL)
            trainer.wait()
            _plant_resume_junk(store, view.spec.run_id)
            logs["trainer2"] = tmp / "trainer2.log"
            trainer = spawn(trainer_args, logs["trainer2"], env)  # no --takeover: see _plant
        assert trainer.wait(timeout=420) == 0, logs.get("trainer2", logs["trainer"]).read_text()[
            -4000:
        ]
        for w, p in zip(("w1", "w2"), workers, strict=True):
            assert p.wait(timeout=90) == 0, logs[w].read_text()[-3000:]
    finally:
        stop.touch()
        for p in (trainer, *workers, *(x for x in (attacker,) if x), *procs):
            if p.poll() is None:
                p.kill()
    return {"store": store, "trust": trust, "logs": logs, "tmp": tmp}


def _tamper_before_join(store: LocalStore) -> None:
    """run.json and a model file altered before any worker joins: signed by
    another key (with that key inside), and a config that is not the model's."""
    env = json.loads(store.get(keys.RUN))
    evil = Signer(Ed25519PrivateKey.generate(), env["run"])
    doc = {**env["doc"], "trainer_key": evil.public.public_bytes_raw().hex(), "inbox": "/tmp/evil"}
    store.put(keys.RUN, evil.seal(keys.RUN, doc))
    name = sorted(env["doc"]["model_files"])[0]
    store.put(keys.model_file(name), b'{"model_type": "evil"}')


def _plant_resume_junk(store: LocalStore, run_id: str) -> None:
    """What a resume must not trip over: a fresh heartbeat of another key (a
    trainer that takes the word of anyone's heartbeat would refuse to start
    without --takeover), a forged ledger, a forged newer checkpoint, a metric
    segment nested to blow the stack, a garbage quarantine list."""
    evil = Signer(Ed25519PrivateKey.generate(), run_id)
    hb = {"instance": "evil0000", "host": "evil", "time": time.time(), "version": 99}
    store.put(keys.HEARTBEAT, evil.seal(keys.HEARTBEAT, hb))
    store.put(
        keys.consumed_key(3, "evil"),
        evil.seal(keys.consumed_key(3, "evil"), {"keys": [], "rejected": [], "digests": []}),
    )
    state = keys.checkpoint_state_key(40)
    store.put(
        state,
        evil.seal(state, {"version": 40, "format": "dcp-safetensors-1", "ranks": 1, "shards": {}}),
    )
    store.put(keys.trainer_segment_key(99), b"[" * 200_000)
    store.put(keys.QUARANTINE, b"\xff\xfe not json")


def _check_clean_end(res: dict) -> dict:
    store: LocalStore = res["store"]
    view = open_run(store, res["trust"])
    trust = view.trust
    assert latest_version(store, trust) == MAX_VERSIONS
    done = read_signed(store, keys.DONE, Done, trust)
    assert done is not None and done.version == MAX_VERSIONS
    kept = sorted({keys.parse_meta_key(k) for k in store.list(keys.WEIGHTS)} - {None})
    # Each version retention kept rebuilds to the hash the trainer signed.
    for v in range(kept[0], MAX_VERSIONS + 1):
        meta = read_meta(store, v, trust)
        f = Follower(store, anchor_every=3, trust=trust)
        f.sync(v)
        assert pulse.state_hash(f.state) == meta.state_hash
    # Never quarantined: no decision in the trainer's logs, nor in its own
    # quarantine.json where that is still the trainer's (the attacker may have
    # written the last copy, after the trainer exited).
    for log in (v for k, v in res["logs"].items() if k.startswith("trainer")):
        assert "quarantined worker w" not in log.read_text()
    with contextlib.suppress(SchemaError):
        quarantine = read_signed(store, keys.QUARANTINE, Quarantine, trust)
        assert quarantine is None or not {"w1", "w2"} & set(quarantine.decisions)
    rows = read_trainer_rows(store, trust)
    groups = {w: c.get("groups", 0) for w, c in rows[-1].per_worker.items()}
    assert groups.get("w1", 0) > 0 and groups.get("w2", 0) > 0, groups  # both worked
    for w in ("w1", "w2"):  # no worker ran a version the trainer did not sign
        ran = {int(v) for v in re.findall(r"now running v(\d+)", res["logs"][w].read_text())}
        assert ran and max(ran) <= MAX_VERSIONS, ran
    return {"peak_mb": max(r.peak_mem_mb for r in rows), "rows": rows, "view": view}


@pytest.mark.timeout(1500)
def test_a_hostile_writer_cannot_stop_starve_or_mislead_the_run(tmp_path):
    clean = _check_clean_end(_run(tmp_path / "clean", hostile=False))
    res = _run(tmp_path / "hostile", hostile=True)
    attacks = (tmp_path / "hostile" / "attacker.log").read_text()
    for kind in (
        "done flag, unsigned",
        "huge version, forged signature",
        "forged next version",
        "squatted future meta.json",
        "forged quarantine",
        "ghost and garbage claims",
        "batch under another worker's name",
        "re-signed copy",
        "junk objects",
    ):
        assert kind in attacks, attacks[-2000:]
    hostile = _check_clean_end(res)
    assert "resumed run" in res["logs"]["trainer2"].read_text()
    # The forgeries were seen and ignored, never acted on.
    unverified = sum(
        r.unverified for rows in read_worker_rows(hostile["view"].inbox).values() for r in rows
    )
    assert unverified > 0
    counts = hostile["rows"][-1].counts
    assert counts.get("rejected_bad_signature", 0) >= 1  # a batch under another worker's name
    # The flood is gone: retention removed every key that is not a registered
    # worker's (claims aside: "" owns them), and every claim of no version.
    owners = {"", "w1", "w2", "w3"}
    left = [k for k in hostile["view"].inbox.list("") if keys.inbox_owner(k) not in owners]
    left += [
        k
        for k in hostile["view"].inbox.list(keys.CLAIMS)
        if keys.parse_claim_key(k)[0] > MAX_VERSIONS + 1
    ]
    assert not left, left[:5]
    assert hostile["peak_mb"] <= clean["peak_mb"] + 300, (hostile["peak_mb"], clean["peak_mb"])
