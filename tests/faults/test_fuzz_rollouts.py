"""Fuzzing the trust boundary: rollout bytes, signatures and episode replay.

Whatever a worker uploads, the trainer's parser answers with a batch or a
counted rejection (SchemaError / SignatureRejected / Rejected), never another
exception. Time-boxed by hypothesis's example counts.
"""

import contextlib
import math

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batch_forge import DTYPES, compress, forge, raw_bytes, split
from colonnade.envs import load_environment
from colonnade.protocol import (
    EpisodeRecord,
    GroupRecord,
    RolloutBatch,
    SchemaError,
    decode_batch,
    keys,
)
from colonnade.protocol.signing import MAGIC, SIG_BYTES, SignatureRejected, sign, verify
from colonnade.train.samples import Rejected, rebuild_group

VOCAB = 64
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


def _valid() -> tuple[dict, dict]:
    ep = EpisodeRecord([1, 2, 3], [True, True, False], [-0.1, -0.2, 0.0], "done")
    _, fields, tensors = split(RolloutBatch("w1", 0, 0, [GroupRecord("s1", [ep, ep])]))
    return fields, dict(tensors)


def _decode(data: bytes):
    try:
        return decode_batch(data, VOCAB, 32)
    except SchemaError:
        return None


def _within_bounds(batch) -> None:
    if batch is None:
        return
    for g in batch.groups:  # whatever passes is within bounds
        for e in g.episodes:
            assert all(isinstance(t, int) and 0 <= t < VOCAB for t in e.tokens)
            assert all(math.isfinite(lp) and -1e4 <= lp <= 0 for lp in e.logprobs)
            assert len(e.tokens) == len(e.from_model) == len(e.logprobs) <= 32
            assert e.from_model[0] is True


@pytest.mark.parametrize("declared", [1 << 61, (64 << 20) + 1, 4 << 30])
def test_a_frame_declaring_a_huge_size_is_refused_before_decompressing(declared):
    # zstandard allocates the size a frame declares, whatever max_output_size
    # says: 2^61 raised MemoryError (found by atheris, tests/faults/test_atheris.py),
    # 4 GiB was a bomb of a 16-byte batch.
    frame = b"\x28\xb5\x2f\xfd\xe0" + declared.to_bytes(8, "little") + b"\x01\x00\x00"
    with pytest.raises(SchemaError, match="declares"):
        decode_batch(frame, VOCAB, 32)


@FAST
@given(st.binary(max_size=2048))
def test_random_bytes(data):
    _within_bounds(_decode(data))
    _within_bounds(_decode(compress(data)))
    # behind a header that announces them truthfully
    _within_bounds(_decode(compress(len(data).to_bytes(8, "little") + data)))


@FAST
@given(st.lists(st.tuples(st.sampled_from(["protocol", "worker", "version", "seq", "stats",
                                            "engine", "groups", "task_id", "finish", "extra"]),
                          json_values), min_size=1, max_size=4))  # fmt: skip
def test_mutated_fields(mutations):
    fields, tensors = _valid()
    # Deepest first, so a replaced parent does not hide where its children were.
    for field, value in sorted(mutations, key=lambda m: m[0] not in ("task_id", "finish")):
        target = fields["groups"][0] if field in ("task_id", "finish") else fields
        if isinstance(target, dict):
            target[field] = value
    try:
        data = forge(fields, tensors)
    except ValueError:  # NaN and friends: the encoder refuses, as a worker's would
        return
    _within_bounds(_decode(data))


DTYPE_NAMES = sorted(DTYPES)


@FAST
@given(st.lists(st.tuples(st.sampled_from(["tokens", "logprobs", "from_model", "lengths"]),
                          st.sampled_from(DTYPE_NAMES), st.binary(max_size=96)),
                min_size=1, max_size=4))  # fmt: skip
def test_mutated_tensors(mutations):
    """Any dtype, any length, any bits (NaN, negative ids, masks of 7) in any tensor."""
    fields, tensors = _valid()
    for name, dtype, bits in mutations:
        dt = np.dtype(DTYPES[dtype])
        tensors[name] = np.frombuffer(bits[: len(bits) // dt.itemsize * dt.itemsize], dt)
    _within_bounds(_decode(forge(fields, tensors)))


@FAST
@given(st.integers(0, 2**64 - 1), st.binary(max_size=64), st.integers(0, 600))
def test_lying_header_sizes_and_cut_bytes(size, tail, cut):
    fields, tensors = _valid()
    raw = raw_bytes(fields, tensors)
    _within_bounds(_decode(compress(size.to_bytes(8, "little") + raw[8:])))
    _within_bounds(_decode(compress(raw[:cut])))
    _within_bounds(_decode(compress(raw + tail)))


PRIVATE = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
KEYRING = {"w1": PRIVATE.public_key()}


@FAST
@given(st.binary(max_size=200))
def test_signature_check_on_random_bytes(data):
    key = keys.rollout_key(0, "w1", 0)
    for ring in (KEYRING, {}):  # a registered worker's key, and none
        with pytest.raises(SignatureRejected):
            verify(data, "r1", key, ring, "w1")
    # A real signature of other bytes (longer than any `data`) does not cover them.
    head = sign(PRIVATE, "r1", key, bytes(201))[: len(MAGIC) + SIG_BYTES]
    with pytest.raises(SignatureRejected):
        verify(head + data, "r1", key, KEYRING, "w1")
    assert verify(sign(PRIVATE, "r1", key, data), "r1", key, KEYRING, "w1") == data


@pytest.fixture(scope="module")
def smoke_and_tok():
    from colonnade.model import load_model, resolve_model

    env = load_environment("smoke", n_tasks=20)
    _, tok = load_model(resolve_model("tiny", env.tokenizer_texts()))
    return env, tok


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.tuples(st.integers(0, 2000), st.booleans()), min_size=1, max_size=30),
       st.sampled_from(["s0", "s1", "s19", "nope"]))  # fmt: skip
def test_replay_of_random_episodes(smoke_and_tok, pairs, task_id):
    env, tok = smoke_and_tok
    ids = [min(t, len(tok) - 1) for t, _ in pairs]
    ep = EpisodeRecord(ids, [m for _, m in pairs], [-0.5] * len(ids), "done")
    train_ids = {t.id for t in env.tasks("train")}
    with contextlib.suppress(Rejected, KeyError):
        rebuild_group(tok, env, GroupRecord(task_id, [ep]), 0, env.stop, 2048, train_ids)
