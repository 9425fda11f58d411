"""Rewards of a worker-run environment (`vf:NAME`): recomputed where the
trainer can, otherwise taken only from workers the operator trusts."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.envs import load_environment
from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch, encode_batch, keys
from colonnade.protocol.schemas import SchemaError, decode_batch, pack_batch, unpack_batch
from colonnade.protocol.signing import sign
from colonnade.store import LocalStore
from colonnade.train.collect import Collector
from colonnade.train.samples import Rejected, rebuild_group
from colonnade.train.trust import RECOMPUTED, TRUSTED, trusts

RUN = "r1"
MAX_LEN = 512


@pytest.fixture(scope="module")
def tok(tiny):
    return tiny[1]


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def _episode(tok, *parts: tuple[str, bool]) -> EpisodeRecord:
    """Model and environment text in order: (text, from the model)."""
    ids, mask = [], []
    for text, mine in parts:
        got = _ids(tok, text)
        ids += got
        mask += [mine] * len(got)
    return EpisodeRecord(ids, mask, [-0.5 if m else 0.0 for m in mask], "done",
                         [0.1 if m else 0.0 for m in mask])  # fmt: skip


def _colour_group(tok, env) -> GroupRecord:
    task = env.tasks("train")[0]
    right = _episode(tok, (f"<answer>{task.answers[0]}</answer>", True))
    wrong = _episode(tok, ("<answer>none</answer>", True))
    return GroupRecord(task.id, [right, wrong], rewards=[0.0, 1.0])  # the worker lies


def _lookup_group(tok, env, answer: str = "123") -> GroupRecord:
    task = env.tasks("train")[0]
    tool = "<|im_end|>\n<|im_start|>tool\n123<|im_end|>\n<|im_start|>assistant\n"
    eps = [_episode(tok, ("<lookup>alpha</lookup>", True), (tool, False),
                    (f"<answer>{answer}</answer>", True)) for _ in range(2)]  # fmt: skip
    return GroupRecord(task.id, eps, rewards=[1.0, 0.25])


def _rebuild(tok, env):
    train = {t.id for t in env.tasks("train")}
    return lambda g, v: rebuild_group(tok, env, g, v, (), MAX_LEN, train)


def test_a_local_rubric_over_one_turn_is_recomputed_the_workers_word_ignored(tok):
    env = load_environment("vf:vf_envs.colour")
    samples = _rebuild(tok, env)(_colour_group(tok, env), 3)
    assert [s.score.reward for s in samples] == [1.0, 0.0]  # not the claimed [0, 1]
    assert [s.reward_from for s in samples] == [RECOMPUTED] * 2
    assert samples[0].score.metrics["correct"] == 1.0
    prompt = samples[0].ids[: samples[0].prompt_len]
    assert tok.decode(prompt).endswith("assistant\n") and "The word is" in tok.decode(prompt)


def test_episodes_with_tool_text_take_the_workers_reward_marked_trusted(tok):
    env = load_environment("vf:vf_envs.lookup")
    group = _lookup_group(tok, env)
    samples = _rebuild(tok, env)(group, 3)
    assert [s.score.reward for s in samples] == [1.0, 0.25]
    assert [s.reward_from for s in samples] == [TRUSTED] * 2
    with pytest.raises(Rejected, match="no reward sent"):
        _rebuild(tok, env)(GroupRecord(group.task_id, group.episodes), 3)
    too_many = _episode(tok, *[("<lookup>a</lookup>", True), ("\nno\n", False)] * 4)
    with pytest.raises(Rejected, match="more than the environment's 3"):
        _rebuild(tok, env)(GroupRecord(group.task_id, [too_many] * 2, [0.0, 0.0]), 3)


def test_rewards_travel_in_the_batch_checked(tok):
    env = load_environment("vf:vf_envs.lookup")
    batch = RolloutBatch("w1", 3, 0, [_lookup_group(tok, env)])
    back = decode_batch(encode_batch(batch), len(tok), 256)
    assert back.groups[0].rewards == [1.0, 0.25]
    plain = RolloutBatch("w1", 3, 0, [GroupRecord("t", _lookup_group(tok, env).episodes)])
    assert unpack_batch(pack_batch(plain), len(tok), 256).groups[0].rewards is None
    raw = pack_batch(batch)
    for bad in (b"[1e999, 0]", b"[1.0     ]", b"[2e+6,0.5]"):  # inf, too few, too large
        assert len(bad) == len(b"[1.0,0.25]")  # the header keeps its length
        with pytest.raises(SchemaError, match="rewards"):
            unpack_batch(raw.replace(b"[1.0,0.25]", bad), len(tok), 256)


def test_the_collector_takes_unrecomputable_rewards_only_from_trusted_workers(tmp_path, tok):
    lookup = load_environment("vf:vf_envs.lookup")
    colour = load_environment("vf:vf_envs.colour")
    keys_ = {w: Ed25519PrivateKey.generate() for w in ("w1", "w2")}
    ring = {w: k.public_key() for w, k in keys_.items()}
    store = LocalStore(tmp_path)

    def put(env, worker, seq, group):
        key = keys.rollout_key(3, worker, seq)
        store.put(key, sign(keys_[worker], RUN, key, encode_batch(RolloutBatch(
            worker, 3, seq, [group]))))  # fmt: skip

    put(lookup, "w1", 0, _lookup_group(tok, lookup))
    put(lookup, "w2", 0, _lookup_group(tok, lookup, "124"))
    c = Collector(store, RUN, _rebuild(tok, lookup), vocab=len(tok), max_tokens=256, max_lag=0,
                  poll_seconds=0.01, keyring=ring, trusted={"w1": ring["w1"]})  # fmt: skip
    got = c.collect(3, need=2, stop=lambda taken: True)
    assert [s.worker for g in got.groups for s in g] == ["w1", "w1"]
    assert c.counts["groups_rejected_untrusted"] == 1 and c.counts["rewards_trusted"] == 2
    # A local rubric's rewards are the trainer's own: anyone's are taken.
    c.rebuild = _rebuild(tok, colour)
    put(colour, "w2", 1, _colour_group(tok, colour))
    got = c.collect(3, need=1, stop=lambda taken: True)
    assert [s.score.reward for s in got.groups[0]] == [1.0, 0.0]
    assert c.counts["rewards_recomputed"] == 2


def test_trust_needs_the_registered_key_itself():
    k1, k2 = Ed25519PrivateKey.generate().public_key(), Ed25519PrivateKey.generate().public_key()
    assert trusts("w1", {"w1": k1}, {"w1": k1})
    assert not trusts("w1", {"w1": k1}, {"w1": k2})  # another key under that id
    assert not trusts("w1", {"w1": k1}, None)  # an unsigned run proves no id
    assert not trusts("w2", {"w1": k1}, {"w2": k1}) and not trusts("w1", None, {"w1": k1})
