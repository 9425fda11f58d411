"""Fuzzing the trust boundary: rollout bytes, signatures and episode replay.

Whatever a worker uploads, the trainer's parser answers with a batch or a
counted rejection (SchemaError / SignatureRejected / Rejected), never another
exception. Time-boxed by hypothesis's example counts.
"""

import contextlib
import json

import pytest
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from colonnade.envs import load_environment
from colonnade.protocol import EpisodeRecord, GroupRecord, SchemaError, decode_batch, keys
from colonnade.protocol.signing import SignatureRejected, verify
from colonnade.train.samples import Rejected, rebuild_group

VOCAB = 64
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4)
    | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


def _valid_doc() -> dict:
    ep = {"tokens": [1, 2, 3], "from_model": [True, True, False], "logprobs": [-0.1, -0.2, 0.0],
          "finish": "done"}  # fmt: skip
    return {"worker": "w1", "version": 0, "seq": 0, "stats": {},
            "groups": [{"task_id": "s1", "episodes": [ep, ep]}]}  # fmt: skip


def _decode(data: bytes):
    try:
        return decode_batch(data, VOCAB, 32)
    except SchemaError:
        return None


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
    _decode(data)
    _decode(zstandard.ZstdCompressor().compress(data))


@FAST
@given(st.lists(st.tuples(st.sampled_from(["worker", "version", "seq", "stats", "groups",
                                            "tokens", "from_model", "logprobs", "finish",
                                            "task_id", "episodes", "extra"]),
                          json_values), min_size=1, max_size=4))  # fmt: skip
def test_mutated_fields(mutations):
    doc = _valid_doc()
    depth = {"tokens": 0, "from_model": 0, "logprobs": 0, "finish": 0, "task_id": 1, "episodes": 1}
    # Deepest first, so a replaced parent does not hide where its children were.
    for field, value in sorted(mutations, key=lambda m: depth.get(m[0], 2)):
        target = doc
        if field in ("tokens", "from_model", "logprobs", "finish"):
            target = doc["groups"][0]["episodes"][0]
        elif field in ("task_id", "episodes"):
            target = doc["groups"][0]
        target[field] = value
    try:
        raw = json.dumps(doc).encode()
    except ValueError:  # NaN and friends: the encoder refuses, as a worker's would
        return
    batch = _decode(zstandard.ZstdCompressor().compress(raw))
    if batch is not None:  # whatever passes is within bounds
        for g in batch.groups:
            for e in g.episodes:
                assert all(0 <= t < VOCAB for t in e.tokens)
                assert all(lp <= 0 for lp in e.logprobs)
                assert len(e.tokens) == len(e.from_model) == len(e.logprobs) <= 32


@FAST
@given(st.binary(max_size=200))
def test_signature_check_on_random_bytes(data):
    with pytest.raises(SignatureRejected):
        verify(data, keys.rollout_key(0, "w1", 0), {})


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
