"""The protocol: keys, schemas of untrusted batches, publishing and following versions."""

import json

import numpy as np
import pytest
import torch
import zstandard
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from batch_forge import compress, forge, raw_bytes, split
from colonnade import pulse
from colonnade.protocol import (
    EpisodeRecord,
    Follower,
    GroupRecord,
    ProtocolMismatch,
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
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.schemas import Latest, batch_bytes_bound, content_digest, pack_batch
from colonnade.protocol.signing import SignatureRejected, Signer, public_hex, read_run_envelope
from colonnade.protocol.weights import read_latest
from colonnade.store import LocalStore


def _signer(run_id="r1"):
    return Signer(Ed25519PrivateKey.generate(), run_id)


def test_keys_round_trip_and_reject_bad_worker_ids():
    k = keys.rollout_key(12, "laptop-1", 7)
    assert k == "laptop-1/rollouts/00000012/000007.safetensors.zst"  # in the inbox, worker first
    assert keys.parse_rollout_key(k) == (12, "laptop-1", 7)
    assert keys.parse_rollout_key("laptop-1/rollouts/00000012/000007.pkl") is None
    # protocol 2's JSON batches are not rollouts of this protocol
    assert keys.parse_rollout_key("laptop-1/rollouts/00000012/000007.json.zst") is None
    # nor is protocol 6's layout, at the run's root
    assert keys.parse_rollout_key("rollouts/00000012/laptop-1/000007.safetensors.zst") is None
    for bad in ("", "../x", "a/b", "-x", "x" * 65, "claims"):  # claims: the shared folder
        with pytest.raises(ValueError):
            keys.heartbeat_key(bad)
        with pytest.raises(ValueError):
            keys.rollout_key(0, bad, 0)
    # a batch under the claims folder is no worker's
    assert keys.parse_rollout_key("claims/rollouts/00000012/000007.safetensors.zst") is None


def _ep(tokens=(5, 6, 7, 8), mask=(1, 1, 0, 1), lps=(-0.5, -1.0, 0.0, -0.25), finish="done"):
    below = [0.25 * m for m in mask]  # exact in float32
    return EpisodeRecord(list(tokens), [bool(m) for m in mask], list(lps), finish, below)


def _batch(**kw):
    ep = _ep()
    return RolloutBatch("w1", 3, 0, [GroupRecord("q1", [ep, ep])], {"reward": 0.5}, **kw)


def test_batch_round_trip():
    got = decode_batch(encode_batch(_batch(slot=17)), vocab=100, max_tokens=16)
    assert got == _batch(slot=17)
    assert isinstance(got.groups[0].episodes[0].tokens[0], int)
    assert isinstance(got.groups[0].episodes[0].from_model[0], bool)
    many = RolloutBatch("w-2.x", 9, 4, [GroupRecord(f"t{i}", [_ep(range(i + 1), [1] * (i + 1),
                        [-0.125] * (i + 1), "eos")] * 3) for i in range(5)], {}, "mlx")  # fmt: skip
    assert decode_batch(encode_batch(many), vocab=100, max_tokens=16) == many


def test_the_engine_field_travels():
    got = decode_batch(encode_batch(_batch(engine="mlx")), vocab=100, max_tokens=16)
    assert got.engine == "mlx" and got == _batch(engine="mlx")


def test_batches_are_safetensors_in_zstd_with_int32_ids_and_float32_logprobs():
    from safetensors.numpy import load

    raw = zstandard.ZstdDecompressor().decompress(encode_batch(_batch()))
    tensors = load(raw)
    assert {k: (v.dtype.str, v.shape) for k, v in tensors.items()} == {
        "tokens": ("<i4", (8,)),
        "logprobs": ("<f4", (8,)),
        "below": ("<f4", (8,)),
        "from_model": ("|u1", (8,)),
        "lengths": ("<i4", (2,)),
    }
    _, fields, _ = split(_batch())
    assert fields == {"protocol": 9, "worker": "w1", "version": 3, "seq": 0, "slot": 0,
                      "engine": "torch", "stats": {"reward": 0.5},
                      "groups": [{"task_id": "q1", "finish": ["done", "done"]}],
                      "tools": []}  # fmt: skip


def test_logprobs_travel_as_float32():
    batch = _batch()
    batch.groups[0].episodes[0] = _ep(lps=(-0.1, -1 / 3, 0.0, -1e-50))
    got = decode_batch(encode_batch(batch), vocab=100, max_tokens=16).groups[0].episodes[0]
    assert got.logprobs == [float(np.float32(x)) for x in (-0.1, -1 / 3, 0.0, -1e-50)]
    # what the torch engine records is a float32 already: it travels exactly
    exact = [float(x) for x in np.float32([-0.1, -2.5e-3, -7.0, 0.0])]
    batch.groups[0].episodes[0] = _ep(lps=exact)
    got = decode_batch(encode_batch(batch), vocab=100, max_tokens=16).groups[0].episodes[0]
    assert got.logprobs == exact


# The digest of _batch()'s first group, pinned: the digest is the content's, not the bytes'.
DIGEST = "a6c73d14b64c4ffb53b81efa349b0c9c6fc435e51bd71057ed2f6c8c07ae4961"


def test_content_digest_does_not_depend_on_the_encoding():
    batch = _batch()
    batch.groups[0].episodes[0] = _ep(lps=(-0.5, -1.0, 0.0, -0.1))  # -0.1: not a float32
    assert content_digest(batch.groups[0]) == DIGEST
    got = decode_batch(encode_batch(batch), vocab=100, max_tokens=16)
    assert content_digest(got.groups[0]) == DIGEST
    # other tensor order, other compression, other log-probs: the same content
    _, fields, tensors = split(batch)
    reordered = dict(reversed(list(tensors.items())))
    reordered["logprobs"] = np.full(8, -2.0, np.float32)
    again = decode_batch(
        zstandard.ZstdCompressor(level=19).compress(raw_bytes(fields, reordered)), 100, 16
    )
    assert content_digest(again.groups[0]) == DIGEST
    # another task or other tokens: another digest
    again.groups[0].task_id = "other"
    assert content_digest(again.groups[0]) != DIGEST


def _fields(edit):
    def apply(fields, tensors):
        edit(fields)

    return apply


def _tensor(name, fn):
    def apply(fields, tensors):
        tensors[name] = fn(tensors[name].copy())

    return apply


def _set(a, i, v):
    a[i] = v
    return a


@pytest.mark.parametrize(
    "edit, why",
    [
        (_tensor("tokens", lambda a: _set(a, 0, 100)), "vocabulary"),
        (_tensor("tokens", lambda a: _set(a, 0, -1)), "vocabulary"),
        (_tensor("tokens", lambda a: np.append(a, 1).astype("<i4")), "as long as tokens"),
        (_tensor("tokens", lambda a: a.astype("<i8")), "tokens: dtype I32"),
        (_tensor("tokens", lambda a: a.astype("<f4")), "tokens: dtype I32"),
        (_tensor("tokens", lambda a: a.reshape(2, 4)), "tokens: one dimension"),
        (_tensor("logprobs", lambda a: _set(a, 0, 0.5)), "logprobs: finite"),
        (_tensor("logprobs", lambda a: _set(a, 1, np.nan)), "logprobs: finite"),
        (_tensor("logprobs", lambda a: _set(a, 1, -np.inf)), "logprobs: finite"),
        (_tensor("logprobs", lambda a: _set(a, 1, -1e5)), "logprobs: finite"),
        (_tensor("logprobs", lambda a: a.astype("<f8")), "logprobs: dtype F32"),
        (_tensor("logprobs", lambda a: a[:-1]), "as long as tokens"),
        (_tensor("from_model", lambda a: _set(a, 0, 0)), "starts with a model token"),
        (_tensor("from_model", lambda a: _set(a, 4, 0)), "starts with a model token"),
        (_tensor("from_model", lambda a: _set(a, 2, 2)), "from_model: 0 or 1"),
        (_tensor("from_model", lambda a: a.astype(bool)), "from_model: dtype U8"),
        (_tensor("lengths", lambda a: np.array([17, -9], "<i4")), "episode length"),
        (_tensor("lengths", lambda a: np.array([3, 3], "<i4")), "do not add up"),
        (_tensor("lengths", lambda a: np.array([0, 8], "<i4")), "episode length"),
        (_tensor("lengths", lambda a: np.array([-4, 12], "<i4")), "episode length"),
        (_tensor("lengths", lambda a: np.array([8], "<i4")), "one per episode"),
        (_fields(lambda d: d["groups"][0]["finish"].__setitem__(0, "x")), "finish"),
        (_fields(lambda d: d["groups"][0]["finish"].append("done")), "one per episode"),
        (_fields(lambda d: d["groups"][0].__setitem__("finish", [])), "finish"),
        (_fields(lambda d: d["groups"][0].__setitem__("task_id", "t" * 257)), "task_id"),
        (_fields(lambda d: d["groups"][0].__setitem__("extra", 1)), "group fields"),
        (_fields(lambda d: d.__setitem__("worker", "../etc")), "worker"),
        (_fields(lambda d: d.__setitem__("worker", 7)), "worker"),
        (_fields(lambda d: d.__setitem__("version", -1)), "version"),
        (_fields(lambda d: d.__setitem__("seq", True)), "version/seq"),
        (_fields(lambda d: d.__setitem__("stats", {"r": "high"})), "stats"),
        (_fields(lambda d: d.__setitem__("groups", [])), "groups"),
        (_fields(lambda d: d.__setitem__("extra", 1)), "fields"),
        (_fields(lambda d: d.pop("engine")), "fields"),
        (_fields(lambda d: d.pop("protocol")), "no protocol"),
        (_fields(lambda d: d.__setitem__("engine", "MLX; rm -rf")), "engine"),
        (_fields(lambda d: d.__setitem__("engine", 7)), "engine"),
    ],
)
def test_bad_batches_are_rejected_with_a_reason(edit, why):
    _, fields, tensors = split(_batch())
    tensors = dict(tensors)
    edit(fields, tensors)
    with pytest.raises(SchemaError, match=why):
        decode_batch(forge(fields, tensors), vocab=100, max_tokens=16)


def _entry(dtype, shape, offsets):
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets}


@pytest.mark.parametrize(
    "head, trailing, why",
    [
        ({"tokens": _entry("I32", [9], [0, 32])}, b"", "disagree with its shape"),
        ({"tokens": _entry("I32", [8], [0, 36])}, b"", "disagree with its shape"),
        ({"tokens": _entry("I32", [8], [4, 36])}, b"", "overlaps or leaves a gap"),
        ({"tokens": _entry("I32", [8], [0, -32])}, b"", "data_offsets"),
        ({"tokens": _entry("I32", [2**62], [0, 32])}, b"", "one dimension"),
        ({"tokens": _entry("I32", [8.0], [0, 32])}, b"", "one dimension"),
        ({"tokens": _entry("I32", [], [0, 32])}, b"", "one dimension"),
        ({"tokens": {"dtype": "I32", "shape": [8]}}, b"", "tokens"),
        ({"tokens": "pickle"}, b"", "tokens"),
        ({"extra": _entry("U8", [0], [0, 0])}, b"", "tensors"),
        ({}, b"\0" * 4, "trailing data"),
        ({}, b"x", "trailing data"),
    ],
)
def test_bad_tensor_headers_are_rejected_with_a_reason(head, trailing, why):
    _, fields, tensors = split(_batch())
    # tokens first in the body, so the other offsets stay as computed
    tensors = {"tokens": tensors["tokens"], **tensors}
    with pytest.raises(SchemaError, match=why):
        decode_batch(forge(fields, tensors, head=head, trailing=trailing), 100, 16)


def test_a_missing_tensor_and_bad_metadata_are_rejected():
    _, fields, tensors = split(_batch())
    less = {k: v for k, v in tensors.items() if k != "lengths"}
    with pytest.raises(SchemaError, match="tensors"):
        decode_batch(forge(fields, less), 100, 16)
    raw = raw_bytes(fields, tensors)
    n = int.from_bytes(raw[:8], "little")
    head = json.loads(raw[8 : 8 + n])
    for meta, why in [({}, "metadata"), ({"colonnade": "{}", "x": "1"}, "metadata"),
                      ({"colonnade": "[1]"}, "not a JSON object"),
                      ({"colonnade": "[" * 40 + "]" * 40}, "nests"),
                      ({"colonnade": "not json"}, "JSON")]:  # fmt: skip
        text = json.dumps({**head, "__metadata__": meta}).encode()
        bad = len(text).to_bytes(8, "little") + text + raw[8 + n :]
        with pytest.raises(SchemaError, match=why):
            decode_batch(compress(bad), 100, 16)


def test_a_key_twice_in_the_header_or_metadata_is_rejected():
    raw = raw_bytes(*split(_batch())[1:])
    n = int.from_bytes(raw[:8], "little")
    text = raw[8 : 8 + n].decode()
    at = text.index('"tokens"')
    first = '"tokens": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}, '
    for bad in (
        text[:at] + first + text[at:],
        text.replace('\\"seq\\": 0', '\\"seq\\": 0, \\"seq\\": 1'),
    ):
        assert bad != text
        data = bad.encode()
        with pytest.raises(SchemaError, match="a key appears twice"):
            decode_batch(compress(len(data).to_bytes(8, "little") + data + raw[8 + n :]), 100, 16)


def test_headers_that_lie_about_their_size_or_nest_are_rejected():
    raw = raw_bytes(*split(_batch())[1:])
    n = int.from_bytes(raw[:8], "little")
    for size in (2**64 - 1, 2**63, len(raw)):
        with pytest.raises(SchemaError, match="bytes follow"):
            decode_batch(compress(size.to_bytes(8, "little") + raw[8:]), 100, 16)
    with pytest.raises(SchemaError, match="JSON"):
        decode_batch(compress((n - 3).to_bytes(8, "little") + raw[8:]), 100, 16)
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(SchemaError, match="nests"):
        decode_batch(compress(len(deep).to_bytes(8, "little") + deep), 100, 16)
    for short in (b"", b"\x08\0\0", raw[:5]):
        with pytest.raises(SchemaError, match="no safetensors header"):
            decode_batch(compress(short), 100, 16)
    with pytest.raises(SchemaError, match="not a JSON document"):
        decode_batch(compress(bytes(8) + b"rest"), 100, 16)


def test_a_json_batch_of_protocol_2_is_refused_naming_both_versions():
    doc = {"engine": "torch", "groups": [], "seq": 0, "stats": {}, "version": 0, "worker": "w1"}
    old = zstandard.ZstdCompressor().compress(json.dumps(doc).encode())
    with pytest.raises(ProtocolMismatch, match="protocol 2; this colonnade speaks 9"):
        decode_batch(old, 100, 16)
    _, fields, tensors = split(_batch())
    for theirs in (2, 3, 4, 5, 6, 7, 8, 10, "9", 9.0, True):  # 8: the release before
        with pytest.raises(ProtocolMismatch, match=f"protocol {theirs!r}; this colonnade speaks 9"):
            decode_batch(forge({**fields, "protocol": theirs}, tensors), 100, 16)


def test_batch_limits_and_garbage():
    with pytest.raises(SchemaError, match="episode length"):
        decode_batch(encode_batch(_batch()), vocab=100, max_tokens=3)
    with pytest.raises(SchemaError, match="zstd"):
        decode_batch(b"not zstd at all", vocab=100, max_tokens=16)
    bomb = zstandard.ZstdCompressor().compress(b" " * (80 << 20))
    with pytest.raises(SchemaError):
        decode_batch(bomb, vocab=100, max_tokens=16)
    data = encode_batch(_batch())
    with pytest.raises(SchemaError, match="zstd"):
        decode_batch(data[:-3], vocab=100, max_tokens=16)
    for tail in (b"\0\0", data):
        with pytest.raises(SchemaError, match="trailing data after the zstd frame"):
            decode_batch(data + tail, vocab=100, max_tokens=16)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(pack_batch(_batch()))
    with pytest.raises(SchemaError, match="declares no size"):
        decode_batch(unsized, vocab=100, max_tokens=16)


def test_the_bound_holds_a_full_honest_batch_and_refuses_one_more_byte():
    # The worst an honest worker sends: every episode of the longest length,
    # one episode a group, task ids of 256 characters that JSON escapes.
    n, tokens = 6, 40
    eps = [_ep(range(tokens), [1] * tokens, [-1.5] * tokens, "length") for _ in range(n)]
    batch = RolloutBatch("w" * 64, 2**40, 999_999, [GroupRecord("\U0001f600" * 128 + '"\\' * 64,
                         [e]) for e in eps], {f"s{i}": -1.0e300 for i in range(32)})  # fmt: skip
    bound = batch_bytes_bound(n, tokens)
    assert len(pack_batch(batch)) <= bound
    assert decode_batch(encode_batch(batch), 100, tokens, bound) == batch
    # anything that inflates past the bound is refused before it is parsed
    _, fields, tensors = split(batch)
    big = raw_bytes(fields, tensors, trailing=b"\0" * bound)
    with pytest.raises(SchemaError, match="zstd"):
        decode_batch(compress(big), 100, tokens, bound)
    # 8 groups of 8 episodes of 512 tokens: 13 bytes a token, 32 for tool replies
    assert batch_bytes_bound(64, 512, 8) == 64 * (512 * (13 + 32) + 64) + 8 * 4096 + (64 << 10)
    assert batch_bytes_bound(64, 512) == batch_bytes_bound(64, 512, 64)
    assert batch_bytes_bound(4096, 1 << 20) == 64 << 20
    # groups of several episodes share a task id
    many = RolloutBatch("w1", 0, 0, [GroupRecord("\U0001f600" * 200 + '"' * 56, eps)], {})
    assert len(pack_batch(many)) <= batch_bytes_bound(n, tokens, 1)


HASH = "blake3:" + "ab" * 32


def _spec(signer=None, **kw):
    key = public_hex((signer or _signer()).public)
    return RunSpec("r1", "smoke", {"n_tasks": 10}, {"config.json": HASH}, 2048, "int8", 4, 2, 1,
                   10, {}, key, **kw)  # fmt: skip


def test_run_spec_round_trip_and_validation():
    spec = _spec()
    assert RunSpec.from_json(spec.to_json()) == spec
    with pytest.raises(SchemaError, match="precision"):
        RunSpec.from_json(spec.to_json().replace(b'"int8"', b'"fp4"'))
    for bad in ({"model_files": ["config.json"]}, {"model_files": {"config.json": "ab" * 32}},
                {"model_files": {"a/b": HASH}}, {"trainer_key": "ab"}, {"inbox": 5},
                {"inbox_endpoint_url": 5}):  # fmt: skip
        with pytest.raises(SchemaError):
            RunSpec.from_dict({**spec.to_dict(), **bad})
    with_inbox = _spec(inbox="s3://inbox/run", inbox_endpoint_url="http://127.0.0.1:9")
    assert RunSpec.from_json(with_inbox.to_json()) == with_inbox
    # The protocol travels in the signed envelope: a run.json of another release
    # (1: the SHA-256 protocol, 6: unsigned, ...) is refused naming both.
    signer = _signer()
    sealed = signer.seal(keys.RUN, _spec(signer).to_dict())
    doc, trust = read_run_envelope(sealed, None)
    assert RunSpec.from_dict(doc) == _spec(signer) and trust.fingerprint == signer.trust.fingerprint
    for old in (b'"protocol":1', b'"protocol":8', b'"protocol":10', b'"protocol":"9"'):
        with pytest.raises(ProtocolMismatch, match=r"protocol \S+; this colonnade speaks 9"):
            read_run_envelope(sealed.replace(b'"protocol":9', old), None)
    with pytest.raises(ProtocolMismatch, match="protocol 6; this colonnade speaks 9"):
        read_run_envelope(json.dumps({**_spec().to_dict(), "protocol": 6}).encode(), None)


def test_an_inbox_bucket_is_reached_where_the_run_store_is_unless_told_otherwise(tmp_path):
    """The trainer records an inbox endpoint only where it differs from the
    run's: a reader given only the run store's (`colonnade status STORE
    --endpoint-url`) reaches the inbox bucket there, not at AWS."""
    from colonnade.protocol.inbox import open_inbox
    from colonnade.store import S3Store

    run = S3Store("run-bucket", "run1", endpoint_url="http://127.0.0.1:9")
    spec = _spec(inbox="s3://inbox-bucket/run1")
    assert open_inbox(run, spec).endpoint_url == "http://127.0.0.1:9"
    lan = "http://10.0.0.5:9"
    assert open_inbox(run, spec, endpoint_url=lan).endpoint_url == lan
    recorded = _spec(inbox="s3://inbox-bucket/run1", inbox_endpoint_url="https://inbox.example")
    assert open_inbox(run, recorded, endpoint_url=lan).endpoint_url == "https://inbox.example"
    assert open_inbox(LocalStore(tmp_path), spec).endpoint_url is None  # AWS


def test_a_run_json_of_protocol_9_point_0_is_refused():
    # The protocol is an integer, as in a batch (9.0 and true are refused there).
    signer = _signer()
    sealed = signer.seal(keys.RUN, _spec(signer).to_dict())
    with pytest.raises(ProtocolMismatch, match=r"protocol 9\.0; this colonnade speaks 9"):
        read_run_envelope(sealed.replace(b'"protocol":9', b'"protocol":9.0'), None)


def test_run_spec_names_every_field_and_groups_per_step_round_trips():
    spec = _spec(groups_per_step=8)
    assert RunSpec.from_json(spec.to_json()).groups_per_step == 8
    earlier = json.loads(spec.to_json())
    del earlier["groups_per_step"]  # run.json without a field: no defaults for a signed run
    with pytest.raises(SchemaError, match="fields differ"):
        RunSpec.from_json(json.dumps(earlier).encode())
    with pytest.raises(SchemaError, match="fields differ"):
        RunSpec.from_json(json.dumps({**spec.to_dict(), "extra": 1}).encode())
    with pytest.raises(SchemaError, match="groups_per_step"):
        RunSpec.from_json(json.dumps({**spec.to_dict(), "groups_per_step": -1}).encode())


def test_run_json_verifies_against_the_key_it_names_and_the_pinned_one():
    signer = _signer()
    sealed = signer.seal(keys.RUN, _spec(signer).to_dict())
    assert read_run_envelope(sealed, signer.trust.fingerprint)[1] == signer.trust
    with pytest.raises(SignatureRejected) as e:  # signed by another key than the pinned one
        read_run_envelope(sealed, _signer().trust.fingerprint)
    assert e.value.reason == "wrong_key"
    # A stranger's run.json naming the trainer's key does not verify.
    forged = _signer().seal(keys.RUN, _spec(signer).to_dict())
    with pytest.raises(SignatureRejected) as e:
        read_run_envelope(forged, None)
    assert e.value.reason == "bad_signature"
    # Neither does one changed after signing, nor an unsigned one.
    env = json.loads(sealed)
    env["doc"]["max_lag"] = 9
    with pytest.raises(SignatureRejected, match="does not verify"):
        read_run_envelope(json.dumps(env).encode(), None)
    env = json.loads(sealed)
    env["signature"] = ""
    with pytest.raises(SignatureRejected) as e:
        read_run_envelope(json.dumps(env).encode(), None)
    assert e.value.reason == "unsigned"
    # Nor one signed for another key (copied from elsewhere in the store).
    moved = signer.seal(keys.LATEST, _spec(signer).to_dict())
    with pytest.raises(SignatureRejected, match="signed for"):
        read_run_envelope(moved, None)


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
    store, signer = LocalStore(tmp_path), _signer()
    trust = signer.trust
    pub = Publisher(store, signer, precision, anchor_every=3)
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
    assert latest_version(store, trust) == 7
    for v, s in enumerate(states):
        f = Follower(store, 3, trust)
        assert f.sync(v)
        assert f.version == v
        assert pulse.state_hash(f.state) == metas[v].state_hash
        assert pulse.state_hash(pulse.prepare(s, precision)) == metas[v].state_hash
    assert [m.patch_bytes > 0 for m in metas] == [False] + [True] * 7  # anchors have one too
    # One follower walking forward reads patches only, across anchors too.
    f = Follower(store, 3, trust)
    f.sync(0)
    start = f.bytes_read
    for v in range(1, 8):
        f.sync(v)
    assert f.bytes_read - start == sum(m.patch_bytes for m in metas[1:])
    assert f.anchors_read == 1 and f.version == 7  # v0's, when it joined
    assert not f.sync(7)
    # A joiner reads the newest anchor and the patches after it.
    j = Follower(store, 3, trust)
    j.sync(7)
    assert j.anchors_read == 1 and j.bytes_read == metas[6].anchor_bytes + metas[7].patch_bytes


@pytest.mark.parametrize("precision", ["int8", "bf16"])
def test_a_follower_patches_in_place_without_a_second_state(tmp_path, precision):
    store, signer = LocalStore(tmp_path), _signer()
    pub = Publisher(store, signer, precision, anchor_every=10)
    states = _states(3)
    for s in states:
        pub.publish(s)
    f = Follower(store, 10, signer.trust)
    copying = Follower(store, 10, signer.trust, in_place=False)
    f.sync(0)
    copying.sync(0)
    held = dict(f.state)
    f.sync(2)
    copying.sync(2)
    assert pulse.state_hash(f.state) == pulse.state_hash(copying.state)
    rewritten = [k for k in f.state if f.state[k] is not held[k]]
    assert rewritten  # new objects where a patch wrote, as after a copying apply...
    for k in rewritten:  # ...over the very memory the state had
        assert f.state[k].data_ptr() == held[k].data_ptr()
    assert any(copying.state[k].data_ptr() != held[k].data_ptr() for k in rewritten)


def test_an_int8_linear_keeps_its_own_copy_of_the_codes():
    # A worker's follower rewrites its state in place while the engine runs.
    from colonnade.model.int8 import Int8Linear

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(-127, 128, (24, 32), generator=gen, dtype=torch.int8)
    scale, bias = torch.rand(24, generator=gen) + 0.1, torch.randn(24, generator=gen)
    layer = Int8Linear(codes, scale, bias)
    x = torch.randn(3, 32, generator=gen)
    before = layer(x)
    codes.add_(1), scale.mul_(2), bias.add_(1)
    assert torch.equal(layer(x), before)


def test_follower_recovers_from_a_corrupt_patch_via_the_anchor(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    pub = Publisher(store, signer, "int8", anchor_every=2)
    metas = [pub.publish(s).meta for s in _states(4)]
    f = Follower(store, 2, signer.trust)
    f.sync(2)
    # v3's patch is replaced by garbage of the same size: its hash fails, so
    # the follower cannot reach v3, and never holds a wrong state.
    store.put(keys.patch_key(3), b"x" * metas[3].patch_bytes)
    with pytest.raises(VersionError):
        f.sync(3)
    assert f.version == 2 and f.state_hash == metas[2].state_hash


def test_latest_carries_the_trainers_seconds_per_version(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    trust = signer.trust
    pub = Publisher(store, signer, "bf16", anchor_every=10)
    states = _states(3)
    pub.publish(states[0])
    assert read_latest(store, trust).version_seconds is None  # one version: no interval yet
    pub.publish(states[1])
    first = read_meta(store, 1, trust).created - read_meta(store, 0, trust).created
    assert read_latest(store, trust).version_seconds == pytest.approx(first, abs=1e-3)
    pub.publish(states[2])
    second = read_meta(store, 2, trust).created - read_meta(store, 1, trust).created
    got = read_latest(store, trust).version_seconds
    assert got == pytest.approx(0.8 * first + 0.2 * second, abs=2e-3)


def test_a_resumed_publisher_does_not_count_its_downtime(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    trust = signer.trust
    states = _states(3)
    first = Publisher(store, signer, "bf16", anchor_every=10)
    first.publish(states[0])
    again = Publisher(store, signer, "bf16", anchor_every=10)  # a trainer resumed after an outage
    again.adopt(0, pulse.prepare(states[0], "bf16"), read_meta(store, 0, trust).state_hash)
    again.point()
    again.publish(states[1])
    assert read_latest(store, trust).version_seconds is None  # v0 -> v1 spans the downtime
    again.publish(states[2])
    assert read_latest(store, trust).version_seconds is not None
    doc = trust.open(keys.LATEST, store.get(keys.LATEST))
    assert Latest.from_dict(doc) == read_latest(store, trust)
    for bad in (-1.0, 1e9, "60"):
        with pytest.raises(SchemaError, match="version_seconds"):
            Latest.from_json(json.dumps({**doc, "version_seconds": bad}).encode())


def test_a_second_publisher_cannot_overwrite_a_version(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    Publisher(store, signer, "bf16", 10).publish(_states(1)[0])
    with pytest.raises(VersionError, match="already published"):
        Publisher(store, signer, "bf16", 10).publish(_states(1, seed=1)[0])
    assert read_meta(store, 0, signer.trust).kind == "full"
    assert read_meta(store, 1, signer.trust) is None


def test_a_meta_json_the_trainer_did_not_sign_is_overwritten_and_never_followed(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    trust = signer.trust
    states = _states(2)
    pub = Publisher(store, signer, "bf16", 10)
    pub.publish(states[0])
    # Someone with the workers' credentials squats v1's meta.json first.
    squat = _signer().seal(keys.meta_key(1), read_meta(store, 0, trust).to_dict())
    store.put(keys.meta_key(1), squat)
    with pytest.raises(SchemaError):
        read_meta(store, 1, trust)
    assert latest_version(store, trust) == 0  # what the trainer did not sign is no version
    with pytest.raises(VersionError, match="does not verify"):
        Follower(store, 10, trust).sync(1)
    assert pub.publish(states[1]).meta.version == 1  # the trainer's own replaces it
    assert read_meta(store, 1, trust).kind == "patch" and latest_version(store, trust) == 1
    # A latest.json the trainer did not sign reads as an error, not as a pointer.
    store.put(keys.LATEST, _signer().seal(keys.LATEST, json.loads(store.get(keys.LATEST))["doc"]))
    with pytest.raises(SchemaError):
        read_latest(store, trust)
    assert latest_version(store, trust) == 1  # found by its signed metas all the same
    assert pub.guard() and read_latest(store, trust).version == 1  # and the trainer's put back


def test_sha256_on_request_and_a_change_of_hash_mid_run(tmp_path):
    store, signer = LocalStore(tmp_path), _signer()
    states = _states(5)
    pub = Publisher(store, signer, "bf16", anchor_every=10, hash_algo="sha256")
    metas = [pub.publish(s).meta for s in states[:3]]
    assert all(m.state_hash.startswith("sha256:") for m in metas)
    assert all(m.patch_hash.startswith("sha256:") for m in metas[1:])
    assert metas[0].anchor_hash.startswith("sha256:")
    # A resumed trainer set to BLAKE3 goes on from a SHA-256 version.
    f = Follower(store, 10, signer.trust)
    f.sync(2)
    again = Publisher(store, signer, "bf16", anchor_every=10)
    again.adopt(2, f.state, f.state_hash)
    metas += [again.publish(s).meta for s in states[3:]]
    assert metas[4].state_hash.startswith("blake3:")
    for v in range(5):
        g = Follower(store, 10, signer.trust)
        g.sync(v)
        assert pulse.state_hash(g.state, metas[v].state_hash.split(":")[0]) == metas[v].state_hash
    f.sync(4)  # a follower holding a SHA-256 hash applies a BLAKE3 patch
    assert f.version == 4 and f.state_hash == metas[4].state_hash


def test_fresh_workers_come_from_one_listing(tmp_path):
    import os
    import time

    from colonnade.protocol.presence import fresh_workers

    inbox = LocalStore(tmp_path)
    for w in ("w1", "w2", "gone"):
        inbox.put(keys.heartbeat_key(w), b"{}")
    old = time.time() - 600
    os.utime(inbox.root / keys.heartbeat_key("gone"), (old, old))
    calls = []
    real = inbox.get
    inbox.get = lambda *a, **k: calls.append(a) or real(*a, **k)
    listing = list_inbox(inbox)
    assert fresh_workers(listing, time.time(), 60) == {"w1", "w2"}
    assert calls == []  # no heartbeat read one by one
    # ids a signed run does not register are not in the run
    assert fresh_workers(list_inbox(inbox, {"w1"}), time.time(), 60) == {"w1"}


def test_a_follower_one_behind_reads_the_pointer_and_the_patch_only(tmp_path):
    from colonnade.protocol import read_latest
    from colonnade.store.counting import Counting

    inner, signer = LocalStore(tmp_path), _signer()
    pub = Publisher(inner, signer, "int8", anchor_every=10)
    states = _states(3)
    pub.publish(states[0])
    pub.publish(states[1])
    store = Counting(inner)
    f = Follower(store, 10, signer.trust)
    f.sync(1)
    pub.publish(states[2])
    store.counts.clear()
    latest = read_latest(store, signer.trust)
    assert latest.version == 2 and not latest.done
    assert f.sync(latest.version, known=latest.meta)
    assert dict(store.counts) == {"get": 2}  # latest.json, then patch.pulse
    assert f.state_hash == latest.meta.state_hash
    pub.quarantined = 1
    pub.point(done=True)
    again = read_latest(inner, signer.trust)
    assert again.done and again.quarantined == 1 and again.meta == latest.meta


def test_a_worker_refuses_a_run_of_another_protocol_in_one_line(tmp_path, capsys):
    from colonnade.cli.main import main

    signer = _signer()
    store = LocalStore(tmp_path)
    # A run of the release before: refused, naming both.
    sealed = signer.seal(keys.RUN, _spec(signer).to_dict())
    store.put(keys.RUN, sealed.replace(b'"protocol":9', b'"protocol":7'))
    assert main(["worker", "--store", str(tmp_path), "--id", "w1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "run.json speaks protocol 7; this colonnade speaks 9" in err
