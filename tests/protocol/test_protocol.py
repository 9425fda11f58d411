"""Protocol v1: keys, schemas of untrusted batches, publishing and following versions."""

import json

import pytest
import torch
import zstandard

from colonnade import pulse
from colonnade.protocol import (
    EpisodeRecord,
    Follower,
    GroupRecord,
    Publisher,
    RolloutBatch,
    RunSpec,
    SchemaError,
    VersionError,
    decode_batch,
    encode_batch,
    keys,
    latest_version,
    read_meta,
)
from colonnade.store import LocalStore


def test_keys_round_trip_and_reject_bad_worker_ids():
    k = keys.rollout_key(12, "laptop-1", 7)
    assert k == "rollouts/00000012/laptop-1/000007.json.zst"
    assert keys.parse_rollout_key(k) == (12, "laptop-1", 7)
    assert keys.parse_rollout_key("rollouts/00000012/laptop-1/000007.pkl") is None
    for bad in ("", "../x", "a/b", "-x", "x" * 65):
        with pytest.raises(ValueError):
            keys.worker_key(bad)


def _batch(**kw):
    ep = EpisodeRecord([5, 6, 7, 8], [True, True, False, True], [-0.5, -1.0, 0.0, -0.1], "done")
    return RolloutBatch("w1", 3, 0, [GroupRecord("q1", [ep, ep])], {"reward": 0.5}, **kw)


def test_batch_round_trip():
    got = decode_batch(encode_batch(_batch()), vocab=100, max_tokens=16)
    assert got == _batch()


def test_the_engine_field_travels_and_old_batches_read_as_torch():
    got = decode_batch(encode_batch(_batch(engine="mlx")), vocab=100, max_tokens=16)
    assert got.engine == "mlx" and got == _batch(engine="mlx")
    old = decode_batch(_raw(lambda d: d.pop("engine")), vocab=100, max_tokens=16)
    assert old.engine == "torch"


def _raw(doc_edit):
    import json

    doc = json.loads(zstandard.ZstdDecompressor().decompress(encode_batch(_batch())))
    doc_edit(doc)
    return zstandard.ZstdCompressor().compress(json.dumps(doc).encode())


@pytest.mark.parametrize(
    "edit, why",
    [
        (lambda d: d["groups"][0]["episodes"][0]["tokens"].__setitem__(0, 100), "vocabulary"),
        (lambda d: d["groups"][0]["episodes"][0]["tokens"].append(1), "as long as"),
        (lambda d: d["groups"][0]["episodes"][0]["logprobs"].__setitem__(0, 0.5), "logprobs"),
        (lambda d: d["groups"][0]["episodes"][0].__setitem__("finish", "x"), "finish"),
        (lambda d: d["groups"][0]["episodes"][0].__setitem__("from_model", "0101"), "starts"),
        (lambda d: d.__setitem__("worker", "../etc"), "worker"),
        (lambda d: d.__setitem__("groups", []), "groups"),
        (lambda d: d.__setitem__("extra", 1), "fields"),
        (lambda d: d["groups"][0]["episodes"][0]["tokens"].__setitem__(0, True), "vocabulary"),
        (lambda d: d.__setitem__("engine", "MLX; rm -rf"), "engine"),
        (lambda d: d.__setitem__("engine", 7), "engine"),
    ],
)
def test_bad_batches_are_rejected_with_a_reason(edit, why):
    with pytest.raises(SchemaError, match=why):
        decode_batch(_raw(edit), vocab=100, max_tokens=16)


def test_batch_limits_and_garbage():
    with pytest.raises(SchemaError, match="episode length"):
        decode_batch(encode_batch(_batch()), vocab=100, max_tokens=3)
    with pytest.raises(SchemaError, match="zstd"):
        decode_batch(b"not zstd at all", vocab=100, max_tokens=16)
    bomb = zstandard.ZstdCompressor().compress(b" " * (80 << 20))
    with pytest.raises(SchemaError):
        decode_batch(bomb, vocab=100, max_tokens=16)


def test_run_spec_round_trip_and_validation():
    spec = RunSpec("r", "smoke", {"n_tasks": 10}, ["config.json"], 2048, "int8", 4, 2, 1, 10, {})
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SchemaError, match="precision"):
        RunSpec.from_json(spec.to_json().replace(b'"int8"', b'"fp4"'))
    for old in (b'"protocol":1', b'"protocol":9'):  # 1: the SHA-256 protocol of earlier releases
        with pytest.raises(SchemaError, match=r"protocol \d; this colonnade speaks 2"):
            RunSpec.from_json(spec.to_json().replace(b'"protocol":2', old))


def test_run_spec_without_groups_per_step_is_read_as_unpaced():
    spec = RunSpec("r", "smoke", {}, [], 2048, "int8", 4, 2, 1, 10, {}, groups_per_step=8)
    assert RunSpec.from_json(spec.to_json()).groups_per_step == 8
    earlier = json.loads(spec.to_json())
    del earlier["groups_per_step"]  # run.json of a release before pacing
    assert RunSpec.from_json(json.dumps(earlier).encode()).groups_per_step == 0
    with pytest.raises(SchemaError, match="groups_per_step"):
        RunSpec.from_json(json.dumps({**earlier, "groups_per_step": -1}).encode())


def _states(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = {"a.weight": torch.randn(16, 32, generator=g), "norm": torch.ones(32)}
    out = [dict(w)]
    for _ in range(n - 1):
        w = {k: v.clone() for k, v in w.items()}
        w["a.weight"][torch.rand(16, 32, generator=g) < 0.05] += 0.01
        out.append(w)
    return out


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_every_version_rebuilds_to_its_hash(tmp_path, precision):
    store = LocalStore(tmp_path)
    pub = Publisher(store, precision, anchor_every=3)
    states = _states(8)
    metas = [pub.publish(s).meta for s in states]
    assert [m.kind for m in metas] == [
        "full",
        "patch",
        "patch",
        "full",
        "patch",
        "patch",
        "full",
        "patch",
    ]
    assert [m.anchor for m in metas] == [0, 0, 0, 3, 3, 3, 6, 6]
    assert latest_version(store) == 7
    for v, s in enumerate(states):
        f = Follower(store, anchor_every=3)
        assert f.sync(v)
        assert f.version == v
        assert pulse.state_hash(f.state) == metas[v].state_hash
        assert pulse.state_hash(pulse.prepare(s, precision)) == metas[v].state_hash
    assert [m.patch_bytes > 0 for m in metas] == [False] + [True] * 7  # anchors have one too
    # One follower walking forward reads patches only, across anchors too.
    f = Follower(store, anchor_every=3)
    f.sync(0)
    start = f.bytes_read
    for v in range(1, 8):
        f.sync(v)
    assert f.bytes_read - start == sum(m.patch_bytes for m in metas[1:])
    assert f.anchors_read == 1 and f.version == 7  # v0's, when it joined
    assert not f.sync(7)
    # A joiner reads the newest anchor and the patches after it.
    j = Follower(store, anchor_every=3)
    j.sync(7)
    assert j.anchors_read == 1 and j.bytes_read == metas[6].anchor_bytes + metas[7].patch_bytes


def test_follower_recovers_from_a_corrupt_patch_via_the_anchor(tmp_path):
    store = LocalStore(tmp_path)
    pub = Publisher(store, "int8", anchor_every=2)
    metas = [pub.publish(s).meta for s in _states(4)]
    f = Follower(store, anchor_every=2)
    f.sync(2)
    # v3's patch is replaced by garbage of the same size: its hash fails, so
    # the follower cannot reach v3, and never holds a wrong state.
    store.put(keys.patch_key(3), b"x" * metas[3].patch_bytes)
    with pytest.raises(VersionError):
        f.sync(3)
    assert f.version == 2 and f.state_hash == metas[2].state_hash


def test_a_second_publisher_cannot_overwrite_a_version(tmp_path):
    store = LocalStore(tmp_path)
    Publisher(store, "bf16", 10).publish(_states(1)[0])
    with pytest.raises(VersionError, match="already published"):
        Publisher(store, "bf16", 10).publish(_states(1, seed=1)[0])
    assert read_meta(store, 0).kind == "full"
    assert read_meta(store, 1) is None


def test_sha256_on_request_and_a_change_of_hash_mid_run(tmp_path):
    store = LocalStore(tmp_path)
    states = _states(5)
    pub = Publisher(store, "bf16", anchor_every=10, hash_algo="sha256")
    metas = [pub.publish(s).meta for s in states[:3]]
    assert all(m.state_hash.startswith("sha256:") for m in metas)
    assert all(m.patch_hash.startswith("sha256:") for m in metas[1:])
    assert metas[0].anchor_hash.startswith("sha256:")
    # A resumed trainer set to BLAKE3 goes on from a SHA-256 version.
    f = Follower(store, anchor_every=10)
    f.sync(2)
    again = Publisher(store, "bf16", anchor_every=10)
    again.adopt(2, f.state, f.state_hash)
    metas += [again.publish(s).meta for s in states[3:]]
    assert metas[4].state_hash.startswith("blake3:")
    for v in range(5):
        g = Follower(store, anchor_every=10)
        g.sync(v)
        assert pulse.state_hash(g.state, metas[v].state_hash.split(":")[0]) == metas[v].state_hash
    f.sync(4)  # a follower holding a SHA-256 hash applies a BLAKE3 patch
    assert f.version == 4 and f.state_hash == metas[4].state_hash


def test_fresh_workers_come_from_one_listing(tmp_path):
    import os
    import time

    from colonnade.protocol.presence import fresh_workers

    store = LocalStore(tmp_path)
    for w in ("w1", "w2", "gone"):
        store.put(keys.worker_key(w), b"{}")
    old = time.time() - 600
    os.utime(store.root / keys.worker_key("gone"), (old, old))
    calls = []
    real = store.get
    store.get = lambda *a, **k: calls.append(a) or real(*a, **k)
    assert fresh_workers(store, time.time(), 60) == {"w1", "w2"}
    assert calls == []  # no heartbeat read one by one


def test_a_follower_one_behind_reads_the_pointer_and_the_patch_only(tmp_path):
    from colonnade.protocol import read_latest
    from colonnade.store.counting import Counting

    inner = LocalStore(tmp_path)
    pub = Publisher(inner, "int8", anchor_every=10)
    states = _states(3)
    pub.publish(states[0])
    pub.publish(states[1])
    store = Counting(inner)
    f = Follower(store, anchor_every=10)
    f.sync(1)
    pub.publish(states[2])
    store.counts.clear()
    latest = read_latest(store)
    assert latest.version == 2 and not latest.done
    assert f.sync(latest.version, known=latest.meta)
    assert dict(store.counts) == {"get": 2}  # latest.json, then patch.pulse
    assert f.state_hash == latest.meta.state_hash
    pub.quarantined = 1
    pub.point(done=True)
    again = read_latest(inner)
    assert again.done and again.quarantined == 1 and again.meta == latest.meta
