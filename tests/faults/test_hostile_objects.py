"""What a hostile worker can put in the inbox, against the real collector and stores.

Each case an attacker tried: JSON nested to blow the stack, things that are
not files, binary batches that lie (dtypes, shapes, lengths, NaN, huge or
nested headers, trailing bytes, another protocol), objects far larger than a
batch, zstd that inflates past what the run asks, copying an honest worker's
payload first, replaying trained episodes re-encoded, keys with a newline or
non-ASCII digits. The trainer's
collector rejects each (counted under a reason) and goes on to the honest
batch beside it; the local store never hangs, never reads past its bound
and never writes outside its root. In an open run an id whose batches were
never accepted gets no per-worker counters (junk under fresh names grows no
state); in a signed run a registered worker that turns hostile is counted
under its own name.
"""

import json
import os
import socket
import tempfile
import threading

import numpy as np
import pytest
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import given
from hypothesis import strategies as st

from batch_forge import compress, forge, raw_bytes, split
from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch, encode_batch, keys
from colonnade.protocol.presence import worker_heartbeats
from colonnade.protocol.schemas import SchemaError, loads
from colonnade.protocol.signing import load_keyring, load_private, new_keypair, sign
from colonnade.store import InvalidObject, LocalStore, ObjectTooLarge, StoreError
from colonnade.train.collect import Collector
from colonnade.train.samples import Sample
from colonnade.untrusted import json_depth
from heartbeats import worker_heartbeat

DEEP = b"[" * 100_000 + b"]" * 100_000
RUN = "r1"
# Registered workers of a signed run (fixed keys), for the cases that count per worker.
PRIVATE = {w: Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32)
           for i, w in enumerate(("attacker", "honest"), 1)}  # fmt: skip
KEYRING = {w: k.public_key() for w, k in PRIVATE.items()}


def _batch(worker, seq=0, version=0, task="t1", tokens=(1, 2)):
    ep = EpisodeRecord(list(tokens), [True] * len(tokens), [-0.1] * len(tokens), "done")
    return RolloutBatch(worker, version, seq, [GroupRecord(task, [ep, ep])])


def _rebuild(group, version):
    return [Sample(group.task_id, version, 1, [0, 1, 2], [True, True], [-0.1, -0.2], None)] * 2


def _collector(inbox, **kw):
    return Collector(inbox, RUN, _rebuild, vocab=10, max_tokens=8, max_lag=1, poll_seconds=0.01,
                     **kw)  # fmt: skip


def _signed(key: str, data: bytes) -> bytes:
    """`data` as the registered worker of `key` uploads it in a signed run."""
    return sign(PRIVATE[keys.parse_rollout_key(key)[1]], RUN, key, data)


def _honest(inbox, worker="honest", seq=0, signed=False, **kw):
    key = keys.rollout_key(0, worker, seq)
    data = encode_batch(_batch(worker, seq, **kw))
    inbox.put(key, _signed(key, data) if signed else data)
    return key


def _in_time(fn, seconds=10):
    """fn() in a thread; fails if it does not return in time (a hang)."""
    out: dict = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), "it hung"
    if "error" in out:
        raise out["error"]
    return out["value"]


# -- 1. nesting -------------------------------------------------------------------------------


def test_deep_json_is_a_schema_error_not_a_crash():
    for doc in (DEEP, b'{"a":' * 300 + b"1" + b"}" * 300, b'{"x": ' + b"[" * 40 + b"]" * 40 + b"}"):
        with pytest.raises(SchemaError, match=r"nests|JSON"):
            loads(doc)
    assert loads(b'{"a": [[1]], "s": "[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["}') is not None


def _nested(leaf, depth):
    return [_nested(leaf, depth - 1)] if depth else leaf


@given(
    st.integers(0, 60),
    st.text(alphabet='[]{}"\\ab', max_size=12),
    st.booleans(),
)
def test_json_depth_measures_what_the_parser_sees(depth, text, as_object):
    doc = _nested({"k": text} if as_object else text, depth)
    data = json.dumps({"d": doc}).encode()
    assert json_depth(data) == 1 + depth + (1 if as_object else 0)


def test_a_deeply_nested_batch_is_rejected_and_the_honest_one_taken(tmp_path):
    store = LocalStore(tmp_path)
    store.put(keys.rollout_key(0, "attacker", 0), zstandard.ZstdCompressor().compress(DEEP))
    honest = _honest(store)
    c = _collector(store)
    got = c.collect(0, need=1, timeout=1)
    assert got.keys == [honest] and len(got.groups) == 1
    assert c.counts["rejected_schema"] == 1 and "attacker" not in c.per_worker


def test_a_deeply_nested_heartbeat_is_skipped(tmp_path):
    inbox = LocalStore(tmp_path)
    inbox.put(keys.heartbeat_key("attacker"), DEEP[:50_000] + DEEP[-50_000:])
    inbox.put(keys.heartbeat_key("nested"), b'{"worker": ' + b"[" * 30 + b"]" * 30 + b"}")
    inbox.put(keys.heartbeat_key("honest"), worker_heartbeat("honest").to_json())
    inbox.put(keys.heartbeat_key("impostor"), worker_heartbeat("honest", version=9).to_json())
    partial = json.dumps({"worker": "partial", "time": 1.0}).encode()
    inbox.put(keys.heartbeat_key("partial"), partial)
    hb = worker_heartbeats(inbox)
    assert set(hb) == {"honest"} and hb["honest"].version == 0


# -- 2. things that are not files -------------------------------------------------------------


def _plant(store, tmp_path, kind, key):
    path = store.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        # A socket's path is short (108 bytes): bound nearby, then moved in place.
        short = tempfile.mkdtemp(dir=tmp_path.anchor + "tmp")
        s = socket.socket(socket.AF_UNIX)
        s.bind(os.path.join(short, "s"))
        os.rename(os.path.join(short, "s"), path)
        return s
    elif kind == "loop":
        os.symlink(path.name, path)
    elif kind == "dev-zero":
        os.symlink("/dev/zero", path)
    elif kind == "outside":
        (tmp_path / "secret").write_bytes(b"not yours")
        os.symlink(tmp_path / "secret", path)
    elif kind == "sparse":
        with open(path, "wb") as f:
            f.truncate(5 << 30)
    return None


@pytest.mark.parametrize("kind", ["fifo", "socket", "loop", "dev-zero", "outside", "sparse"])
def test_objects_that_are_not_files_are_refused_at_once(tmp_path, kind):
    store = LocalStore(tmp_path / "store")
    key = keys.rollout_key(0, "attacker", 0)
    held = _plant(store, tmp_path, kind, key)
    try:
        expected = ObjectTooLarge if kind == "sparse" else InvalidObject
        with pytest.raises(expected):
            _in_time(lambda: store.get(key, max_bytes=64 << 20))
        honest = _honest(store)
        c = _collector(store)
        got = _in_time(lambda: c.collect(0, need=1, timeout=1))
        assert got.keys == [honest] and got.rejected == [key]
        assert c.counts["rejected_object"] == 1
    finally:
        if held is not None:
            held.close()


def test_a_file_where_a_folder_should_be_is_a_store_error(tmp_path):
    store = LocalStore(tmp_path)
    (tmp_path / "honest" / "rollouts").mkdir(parents=True)
    (tmp_path / "honest" / "rollouts" / "00000000").write_bytes(b"in the way")
    with pytest.raises(StoreError, match="file stands where its folder should"):
        store.put_if_absent(keys.rollout_key(0, "honest", 0), b"batch")


def test_a_symlinked_folder_cannot_lead_writes_or_reads_outside(tmp_path):
    store = LocalStore(tmp_path / "store")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / f"000001{keys.ROLLOUT_EXT}").write_bytes(b"outside")
    (store.root / "honest" / "rollouts").mkdir(parents=True)
    os.symlink(outside, store.root / "honest" / "rollouts" / "00000000")
    with pytest.raises(InvalidObject, match="out of the store"):
        store.put_if_absent(keys.rollout_key(0, "honest", 0), b"batch")
    with pytest.raises(InvalidObject):
        store.get(keys.rollout_key(0, "honest", 1))
    assert not (outside / f"000000{keys.ROLLOUT_EXT}").exists()
    assert store.list("honest/") == []  # a symlinked folder is not walked


# -- 2b. hostile binary batches ------------------------------------------------------------


def _parts():
    _, fields, tensors = split(_batch("attacker"))
    return fields, dict(tensors)


def _hostile_batches() -> dict[str, tuple[bytes, str]]:
    """name -> (object bytes, the reason the collector counts it under)."""
    fields, t = _parts()
    raw = raw_bytes(fields, t)
    n = int.from_bytes(raw[:8], "little")
    lp64 = t["logprobs"].astype("<f8")
    past = {"dtype": "I32", "shape": [4096], "data_offsets": [0, 16]}
    json_batch = {"worker": "attacker", "version": 0, "seq": 0, "stats": {}, "engine": "torch",
                  "groups": [{"task_id": "t1", "episodes": []}]}  # fmt: skip
    return {
        "ids as int64": (forge(fields, {**t, "tokens": t["tokens"].astype("<i8")}), "schema"),
        "ids as float32": (forge(fields, {**t, "tokens": t["tokens"].astype("<f4")}), "schema"),
        "ids 2-D": (forge(fields, {**t, "tokens": t["tokens"].reshape(2, 2)}), "schema"),
        "id past the vocabulary": (forge(fields, {**t, "tokens": t["tokens"] + 10}), "schema"),
        "negative id": (forge(fields, {**t, "tokens": t["tokens"] - 5}), "schema"),
        "NaN log-prob": (forge(fields, {**t, "logprobs": t["logprobs"] * np.nan}), "schema"),
        "positive log-prob": (forge(fields, {**t, "logprobs": -t["logprobs"]}), "schema"),
        "log-probs as float64": (forge(fields, {**t, "logprobs": lp64}), "schema"),
        "mask of 2": (forge(fields, {**t, "from_model": t["from_model"] * 2}), "schema"),
        "lengths that disagree": (forge(fields, {**t, "lengths": t["lengths"] + 1}), "schema"),
        "a length per token": (forge(fields, {**t, "lengths": np.ones(4, "<i4")}), "schema"),
        "shape past its data": (forge(fields, t, head={"tokens": past}), "schema"),
        "trailing data": (compress(raw + b"\0" * 64), "schema"),
        "bytes after the frame": (encode_batch(_batch("attacker")) + b"tail", "schema"),
        "huge header": (compress((1 << 62).to_bytes(8, "little") + raw[8:]), "schema"),
        "nested header": (compress(len(DEEP).to_bytes(8, "little") + DEEP), "schema"),
        "nested metadata": (forge({"x": _nested(1, 200)}, t), "schema"),
        "a pickle": (compress(b"\x80\x04\x95" + raw), "schema"),
        "header cut short": (compress(raw[: 8 + n // 2]), "schema"),
        "protocol 10": (forge({**fields, "protocol": 10}, t), "protocol"),
        "protocol 8 (the last release)": (forge({**fields, "protocol": 8}, t), "protocol"),
        "protocol 5 (PULSE format 2)": (forge({**fields, "protocol": 5}, t), "protocol"),
        "a JSON batch (protocol 2)": (compress(json.dumps(json_batch).encode()), "protocol"),
    }


@pytest.mark.parametrize("signed", [False, True], ids=["open", "signed"])
@pytest.mark.parametrize("name", list(_hostile_batches()))
def test_hostile_binary_batches_are_rejected_and_the_honest_one_taken(tmp_path, name, signed):
    # Signed: a registered worker turned hostile; its signature holds, its bytes do not.
    data, reason = _hostile_batches()[name]
    inbox = LocalStore(tmp_path)
    key = keys.rollout_key(0, "attacker", 0)
    inbox.put(key, _signed(key, data) if signed else data)
    honest = _honest(inbox, signed=signed)
    c = _collector(inbox, keyring=KEYRING if signed else None)
    got = _in_time(lambda: c.collect(0, need=1, timeout=1))
    assert got.keys == [honest] and len(got.groups) == 1
    assert got.rejected == [key]
    assert c.counts[f"rejected_{reason}"] == 1 and c.counts["batches_rejected"] == 1
    if signed:
        assert c.per_worker["attacker"]["batches_rejected"] == 1
        assert c.per_worker["attacker"][f"rejected_{reason}"] == 1
    else:
        assert "attacker" not in c.per_worker


@pytest.mark.parametrize(
    "forgery, reason",
    [
        ("unsigned", "unsigned"),
        ("another worker's key", "bad_signature"),
        ("signed for another key", "bad_signature"),
        ("signed for another run", "bad_signature"),
        ("an id not registered", None),
    ],
)
def test_a_signed_run_takes_only_batches_its_worker_signed(tmp_path, forgery, reason):
    inbox = LocalStore(tmp_path)
    data = encode_batch(_batch("attacker"))
    key = keys.rollout_key(0, "attacker", 0)
    other = keys.rollout_key(0, "attacker", 1)
    forged = {
        "unsigned": data,
        "another worker's key": sign(PRIVATE["honest"], RUN, key, data),
        "signed for another key": sign(PRIVATE["attacker"], RUN, other, data),
        "signed for another run": sign(PRIVATE["attacker"], "r2", key, data),
    }
    if reason is None:  # never read: retention deletes it
        key = keys.rollout_key(0, "stranger", 0)
        forged[forgery] = encode_batch(_batch("stranger"))
    inbox.put(key, forged[forgery])
    honest = _honest(inbox, signed=True)
    c = _collector(inbox, keyring=KEYRING)
    got = _in_time(lambda: c.collect(0, need=1, timeout=1))
    assert got.keys == [honest] and len(got.groups) == 1
    if reason is None:
        assert got.rejected == [] and c.counts["batches_rejected"] == 0
        assert "stranger" not in c.per_worker
    else:
        assert got.rejected == [key] and c.counts[f"rejected_{reason}"] == 1
        assert c.per_worker["attacker"][f"rejected_{reason}"] == 1


def test_a_protocol_mismatch_names_both_versions(tmp_path, caplog):
    store = LocalStore(tmp_path)
    fields, t = _parts()
    store.put(keys.rollout_key(0, "attacker", 0), forge({**fields, "protocol": 5}, t))
    c = _collector(store)
    with caplog.at_level("WARNING", logger="colonnade.trainer"):
        c.collect(0, need=1, timeout=0.2)
    (line,) = [r.getMessage() for r in caplog.records if "rejected batch" in r.getMessage()]
    assert "(protocol)" in line and "speaks protocol 5; this colonnade speaks 9" in line
    assert "\n" not in line


# -- 3. bounded reads ------------------------------------------------------------------------


class Recording(LocalStore):
    def get(self, key, *, max_bytes=None):
        self.bounds = [*getattr(self, "bounds", []), max_bytes]
        return super().get(key, max_bytes=max_bytes)


def test_every_batch_read_is_bounded_and_inflation_is_bounded_by_the_run(tmp_path):
    store = Recording(tmp_path)
    # 6 KiB that inflates to 64 MiB of JSON: far more than a batch of this run holds.
    bomb = b'{"x": "' + b"a" * (64 << 20) + b'"}'
    store.put(keys.rollout_key(0, "attacker", 0), zstandard.ZstdCompressor(level=19).compress(bomb))
    honest = _honest(store)
    c = _collector(store, max_raw=1 << 20)
    got = c.collect(0, need=1, timeout=1)
    assert got.keys == [honest] and c.counts["rejected_schema"] == 1
    assert store.bounds and all(b is not None and b <= 64 << 20 for b in store.bounds)


# -- 4 and 5. replays ------------------------------------------------------------------------


def test_a_copy_sent_first_under_another_name_does_not_shut_out_the_original(tmp_path):
    store = LocalStore(tmp_path)
    payload = encode_batch(_batch("honest"))
    # "a-copycat" is taken before "honest" (workers in turn, by name).
    store.put(keys.rollout_key(0, "a-copycat", 0), payload)
    original = keys.rollout_key(0, "honest", 0)
    store.put(original, payload)
    c = _collector(store)
    got = c.collect(0, need=1, timeout=1)
    assert got.keys == [original] and len(got.groups) == 1
    assert c.counts["rejected_schema"] == 1 and c.counts.get("rejected_replay", 0) == 0


def test_trained_episodes_re_encoded_under_another_name_are_a_replay(tmp_path, monkeypatch):
    store = LocalStore(tmp_path)
    _honest(store)
    c = _collector(store)
    first = c.collect(0, need=1, timeout=1)
    assert len(first.groups) == 1 and len(first.digests) == 1
    # The same episodes, other tensor order, metadata and compression, another
    # name and seq, other log-probs.
    _, fields, tensors = split(_batch("honest"))
    fields.update(worker="thief", seq=7, stats={"reward_claimed": 1.0})
    tensors = dict(reversed(list(tensors.items())))
    tensors["logprobs"] = tensors["logprobs"] * 0.5
    body = raw_bytes(dict(reversed(list(fields.items()))), tensors)
    store.put(keys.rollout_key(0, "thief", 7), zstandard.ZstdCompressor(level=12).compress(body))
    again = c.collect(0, need=1, timeout=0.3)
    assert again.groups == [] and c.counts["rejected_replay"] == 1
    # A restarted trainer knows them from the ledger's digests.
    c2 = _collector(store, seen=set(first.digests), consumed={first.keys[0]})
    assert c2.collect(0, need=1, timeout=0.3).groups == []
    assert c2.counts["rejected_replay"] == 1


def test_two_signed_workers_sending_the_same_episodes_the_first_wins(tmp_path):
    keydir = tmp_path / "keys"
    for w in ("w1", "w2"):
        new_keypair(w, keydir)
    store = LocalStore(tmp_path / "store")
    for w in ("w1", "w2"):
        _, private = load_private(keydir / f"{w}.key")
        key = keys.rollout_key(0, w, 0)
        store.put(key, sign(private, RUN, key, encode_batch(_batch(w))))
    c = _collector(store, keyring=load_keyring(keydir))
    got = c.collect(0, need=2, timeout=0.5)
    assert got.keys == [keys.rollout_key(0, "w1", 0)] and len(got.groups) == 1
    assert c.per_worker["w2"]["rejected_replay"] == 1


# -- keys --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key",
    [
        "w1/rollouts/00000000/000000.safetensors.zst\n",
        "w1/rollouts/٠٠٠٠٠٠٠٠/000000.safetensors.zst",
        "w1/rollouts/00000000/٠٠٠٠٠٠.safetensors.zst",
        "w1\n/rollouts/00000000/000000.safetensors.zst",
        "w" * 65 + "/rollouts/00000000/000000.safetensors.zst",
        "w1/rollouts/00000000/000000.safetensors",
        "w1/rollouts/00000000/000000.json.zst",  # protocol 2's
        "rollouts/00000000/w1/000000.safetensors.zst",  # protocol 6's, at the run's root
        "claims/rollouts/00000000/000000.safetensors.zst",  # the shared folder is no worker
        "inbox/w1/rollouts/00000000/000000.safetensors.zst",  # keys are the inbox's own
    ],
)
def test_key_patterns_are_strict(key):
    assert keys.parse_rollout_key(key) is None
    assert keys.inbox_owner(key) is None
    assert keys.parse_rollout_key(keys.rollout_key(0, "w1", 0)) == (0, "w1", 0)


def test_worker_ids_are_strict():
    for bad in ("w1\n", "w١", "", "-w", "w" * 65, "claims"):
        with pytest.raises(ValueError):
            keys.check_worker_id(bad)
    assert keys.check_worker_id("w-1.a_b") == "w-1.a_b"


# -- against a real trainer ---------------------------------------------------------------


@pytest.mark.procs
@pytest.mark.timeout(300)
def test_a_real_trainer_survives_them_and_counts_them_across_a_restart(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    from colonnade.protocol import latest_version
    from colonnade.protocol.documents import ConsumedLedger, read_signed
    from colonnade.protocol.reader import open_run
    from colonnade.report import build_report
    from colonnade.telemetry import trainer_rows

    root = tmp_path / "run"
    env = {**os.environ, "COLONNADE_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cli = [sys.executable, "-m", "colonnade"]
    args = ["trainer", "--store", str(root), "--preset", "smoke", "--checkpoint-every", "1",
            "--retain-all"]  # fmt: skip

    def trainer(versions, log):
        out = (tmp_path / log).open("w")
        return subprocess.Popen([*cli, *args, "--max-versions", str(versions), "--takeover"],
                                env=env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip

    def wait(cond, what, procs=()):
        t0 = time.monotonic()
        while not cond():
            assert all(p.poll() in (None, 0) for p in procs), f"a process died before {what}"
            assert time.monotonic() - t0 < 200, f"timed out waiting for {what}"
            time.sleep(0.2)

    store = LocalStore(root)
    first = trainer(20, "trainer1.log")
    wait(lambda: store.exists(keys.RUN), "run.json", [first])
    view = open_run(store)
    inbox, trust = view.inbox, view.trust
    inbox.put(keys.rollout_key(0, "attacker", 0), zstandard.ZstdCompressor().compress(DEEP))
    _plant(inbox, tmp_path, "fifo", keys.rollout_key(0, "attacker", 1))
    _plant(inbox, tmp_path, "dev-zero", keys.rollout_key(0, "attacker", 2))
    inbox.put(keys.heartbeat_key("attacker"), DEEP)
    worker_log = (tmp_path / "w.log").open("w")
    worker = subprocess.Popen([*cli, "worker", "--store", str(root), "--id", "honest",
                               "--trust", trust.fingerprint], env=env,
                              stdout=worker_log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        wait(lambda: (latest_version(store, trust) or 0) >= 2, "v2", [first, worker])
        first.send_signal(signal.SIGKILL)
        first.wait()
        second = trainer(4, "trainer2.log")
        assert second.wait(timeout=200) == 0, (tmp_path / "trainer2.log").read_text()[-3000:]
        assert worker.wait(timeout=60) == 0
    finally:
        for p in (first, worker):
            if p.poll() is None:
                p.kill()
    report = build_report(store)
    assert report["versions_published"] == 4
    assert report["rejected_by_reason"] == {"schema": 1, "object": 2}  # counted once, kept
    assert report["rollouts_rejected"] == 3
    # Trained batches only: the steps' own counts. The ledgers may list more:
    # the killed trainer's last step consumed batches whose row it never wrote.
    rows = trainer_rows(store, trust)
    ledgers = [read_signed(store, k, ConsumedLedger, trust) for k in store.list(keys.CONSUMED)]
    ledgered = sum(len(d.keys) for d in ledgers)
    assert report["rollouts_consumed"] == sum(r["batches_trained"] for r in rows) > 0
    assert report["rollouts_consumed"] <= ledgered
    assert sorted(k for d in ledgers for k in d.rejected) == [
        keys.rollout_key(0, "attacker", i) for i in range(3)
    ]
