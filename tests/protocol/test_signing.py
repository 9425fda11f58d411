"""Signed rollout objects: what verifies, what is rejected and why it is counted."""

import stat

import pytest

from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch, encode_batch, keys
from colonnade.protocol.signing import (
    SignatureRejected,
    load_keyring,
    load_private,
    new_keypair,
    sign,
    strip_unsigned,
    verify,
)
from colonnade.store import LocalStore
from colonnade.train.collect import Collector
from colonnade.train.samples import Sample


@pytest.fixture
def keydir(tmp_path):
    for w in ("w1", "w2"):
        new_keypair(w, tmp_path / "keys")
    return tmp_path / "keys"


def _payload(worker="w1", version=0, seq=0, task="t1"):
    ep = EpisodeRecord([1, 2], [True, True], [-0.1, -0.2], "done")
    return encode_batch(RolloutBatch(worker, version, seq, [GroupRecord(task, [ep, ep])]))


def test_sign_and_verify(keydir):
    ring = load_keyring(keydir)
    _, w1 = load_private(keydir / "w1.key")
    key = keys.rollout_key(0, "w1", 0)
    data = sign(w1, "r1", key, _payload())
    assert verify(data, "r1", key, ring, "w1") == _payload() == strip_unsigned(data)

    def reason(data, key, worker=None, run="r1", ring=ring):
        worker = worker or keys.parse_rollout_key(key)[1]
        with pytest.raises(SignatureRejected) as e:
            verify(data, run, key, ring, worker)
        return e.value.reason

    tampered = data[:-1] + bytes([data[-1] ^ 1])
    assert reason(tampered, key) == "bad_signature"
    # The same valid object copied under another seq, version or worker.
    assert reason(data, keys.rollout_key(0, "w1", 1)) == "bad_signature"
    assert reason(data, keys.rollout_key(1, "w1", 0)) == "bad_signature"
    assert reason(data, keys.rollout_key(0, "w2", 0)) == "bad_signature"
    assert reason(data, keys.rollout_key(0, "w3", 0)) == "unknown_key"
    # ... or into another run signed by the same key
    assert reason(data, key, run="r2") == "bad_signature"
    # checked against the key of the worker it is verified for, not any registered one
    assert reason(data, key, worker="w2") == "bad_signature"
    assert reason(_payload(), key) == "unsigned"
    assert reason(b"", key) == "unsigned"


def test_key_files(tmp_path, keydir):
    assert stat.S_IMODE((keydir / "w1.key").stat().st_mode) == 0o600
    with pytest.raises(FileExistsError):
        new_keypair("w1", keydir)
    assert set(load_keyring(keydir)) == {"w1", "w2"}
    assert set(load_keyring(keydir / "w2.pub")) == {"w2"}
    (tmp_path / "dup").mkdir()
    (tmp_path / "dup" / "a.pub").write_text((keydir / "w1.pub").read_text())
    (tmp_path / "dup" / "b.pub").write_text((keydir / "w1.pub").read_text())
    with pytest.raises(ValueError, match="second key"):
        load_keyring(tmp_path / "dup")
    (tmp_path / "bad.pub").write_text('{"worker": "w1", "public_key": "abcd"}')
    with pytest.raises(ValueError, match="32 bytes"):
        load_keyring(tmp_path / "bad.pub")
    (keydir.parent / "store").mkdir()
    with pytest.raises(ValueError, match="no public keys"):
        load_keyring(keydir.parent / "store")  # a folder without .pub files
    with pytest.raises(ValueError, match="invalid worker id"):
        new_keypair("../evil", tmp_path)


def _rebuild(group, version):
    return [Sample(group.task_id, version, 1, [0, 1, 2], [True, True], [-0.1, -0.2], None)] * 2


def test_collector_takes_only_signed_batches_once(tmp_path, keydir):
    inbox = LocalStore(tmp_path / "inbox")
    _, w1 = load_private(keydir / "w1.key")

    def put(worker, seq, data):
        inbox.put(keys.rollout_key(0, worker, seq), data)

    put("w1", 0, sign(w1, "r1", keys.rollout_key(0, "w1", 0), _payload(seq=0)))  # good
    put("w1", 1, sign(w1, "r1", keys.rollout_key(0, "w1", 1), _payload(seq=0)))  # replayed
    put("w1", 2, _payload(seq=2, task="t2"))  # unsigned
    # w1 signing as w2
    put("w2", 0, sign(w1, "r1", keys.rollout_key(0, "w2", 0), _payload("w2", task="t3")))
    # w2's own, but signed for another run
    put("w2", 1, sign(w1, "r2", keys.rollout_key(0, "w2", 1), _payload("w2", 0, 1, "t5")))
    put("w9", 0, _payload("w9", task="t4"))  # no registered key: never read, nor counted
    c = Collector(inbox, "r1", _rebuild, 10, 8, 1, 0.01, keyring=load_keyring(keydir))
    reads = []
    real = inbox.get
    inbox.get = lambda key, **kw: reads.append(key) or real(key, **kw)
    got = c.collect(0, need=5, timeout=0.3)
    assert len(got.groups) == 1 and len(got.digests) == 1
    assert got.keys == [keys.rollout_key(0, "w1", 0)]
    assert c.counts["batches_rejected"] == 4
    assert c.counts["rejected_replay"] == 1 and c.counts["rejected_bad_signature"] == 2
    assert c.counts["rejected_unsigned"] == 1
    assert c.per_worker["w2"]["rejected_bad_signature"] == 2
    assert "w9" not in c.per_worker and keys.rollout_key(0, "w9", 0) not in reads
    # Without a keyring (a run that does not sign) signed objects still parse.
    inbox.get = real
    c2 = Collector(inbox, "r1", _rebuild, 10, 8, 1, 0.01)
    assert len(c2.collect(0, need=5, timeout=0.3).groups) >= 2


def test_a_worker_without_a_key_cannot_join_a_signed_run(tmp_path, signed_run):
    from colonnade.config import WorkerConfig
    from colonnade.rollout.worker import Worker

    store = LocalStore(tmp_path / "store")
    signed_run(store, vocab_size=10, group_size=2, groups_per_batch=1, signed=True)
    w = Worker(WorkerConfig(store=str(tmp_path / "store"), id="w1"), store)
    with pytest.raises(ValueError, match="only signed batches"):
        w.setup()


def test_worker_id_comes_from_its_key(tmp_path, keydir):
    from colonnade.config import WorkerConfig
    from colonnade.rollout.worker import Worker

    store = LocalStore(tmp_path / "store")
    w = Worker(WorkerConfig(store="x", key=str(keydir / "w2.key")), store)
    assert w.id == "w2"
    with pytest.raises(ValueError, match="w2"):
        Worker(WorkerConfig(store="x", id="w1", key=str(keydir / "w2.key")), store)


def test_trust_is_a_key_file_or_its_fingerprint(tmp_path, keydir):
    from colonnade.protocol.signing import (
        fingerprint,
        is_fingerprint,
        keyring_json,
        load_public,
        public_hex,
        trusted_fingerprint,
    )

    worker, public = load_public(keydir / "w1.pub")
    assert worker == "w1" and load_public(keydir / "w1.key")[1] == public  # a .key's public half
    fp = fingerprint(public)
    assert is_fingerprint(fp) and fp.startswith("SHA256:")
    assert fp != fingerprint(load_public(keydir / "w2.pub")[1])
    for value in (str(keydir / "w1.pub"), str(keydir / "w1.key"), fp):
        assert trusted_fingerprint(value) == fp
    for bad in ("SHA256:short", str(tmp_path / "missing.pub"), ""):
        with pytest.raises(ValueError, match="--trust"):
            trusted_fingerprint(bad)
    ring = load_keyring(keydir)
    assert keyring_json(ring) == {w: public_hex(k) for w, k in ring.items()}
    assert list(keyring_json(ring)) == ["w1", "w2"]
