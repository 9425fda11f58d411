"""An episode whose tool reply would pass its token budget ends as `overflow`:
the batch carries the reason, the trainer replays and counts it, the
worker's row and the report show it."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.envs import load_environment
from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch, encode_batch, keys
from colonnade.protocol.metrics import WorkerRow
from colonnade.protocol.schemas import decode_batch
from colonnade.protocol.signing import sign
from colonnade.protocol.turns import chat_reply, episode_stops
from colonnade.rollout.tally import Tally
from colonnade.store import LocalStore
from colonnade.train.collect import Collector
from colonnade.train.samples import rebuild_group

RUN = "r1"


@pytest.fixture(scope="module")
def chat(tiny):
    env = load_environment("chattools", n_tasks=10)
    return env, tiny[1]


def _group(env, tok) -> GroupRecord:
    """Two episodes of one task: one answered after its tool reply, one
    whose reply did not fit (the worker's engine ended it there)."""
    task = env.tasks("train")[0]
    call = f'<tool_call>{{"name": "price", "arguments": {{"item": "{task.info["item"]}"}}}}'
    call += "</tool_call>"
    parts = [(call, True), (chat_reply(tok, env, task, [call]), False), (task.answers[0], True)]
    eps = []
    for shown, finish in ((parts, "eos"), (parts[:1], "overflow")):
        ids, mask = [], []
        for text, mine in shown:
            got = tok.encode(text, add_special_tokens=False)
            ids, mask = ids + got, mask + [mine] * len(got)
        probs = [-0.5 if m else 0.0 for m in mask]
        eps.append(EpisodeRecord(ids, mask, probs, finish, [0.0] * len(ids)))
    return GroupRecord(task.id, eps)


def test_the_trainer_replays_and_counts_overflowed_episodes(tmp_path, chat):
    env, tok = chat
    group = _group(env, tok)
    key = Ed25519PrivateKey.generate()
    store = LocalStore(tmp_path)
    batch = RolloutBatch("w1", 3, 0, [group])
    assert [
        e.finish for e in decode_batch(encode_batch(batch), len(tok), 4096).groups[0].episodes
    ] == [
        "eos",
        "overflow",
    ]
    name = keys.rollout_key(3, "w1", 0)
    store.put(name, sign(key, RUN, name, encode_batch(batch)))
    train = {t.id for t in env.tasks("train")}
    stop = episode_stops((), env)

    def rebuild(g, v):
        return rebuild_group(tok, env, g, v, stop, 4096, train)

    c = Collector(store, RUN, rebuild, vocab=len(tok), max_tokens=4096, max_lag=0,
                  poll_seconds=0.01, keyring={"w1": key.public_key()})  # fmt: skip
    got = c.collect(3, need=1, stop=lambda taken: True)
    assert [s.score.reward for s in got.groups[0]] == [1.0, 0.0]  # unanswered: no reward
    assert c.counts["episodes_overflow"] == 1 and c.counts["groups_rejected"] == 0


def test_a_workers_row_counts_its_overflowed_episodes(chat):
    env, tok = chat
    batch = RolloutBatch("w1", 3, 0, [_group(env, tok)])
    tally = Tally()
    tally.counts["overflows"] += 1
    row = tally.row(batch, 1.0, None)
    assert WorkerRow.from_dict(row.to_dict()).overflows == 1
    assert tally.row(batch, 1.0, None).overflows == 0  # since the previous row
