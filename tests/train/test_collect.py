"""The collector: only fresh enough, unconsumed batches; stale ones counted once."""

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch, encode_batch, keys
from colonnade.protocol.signing import sign
from colonnade.store import LocalStore
from colonnade.train.collect import Collector, take_order
from colonnade.train.samples import Rejected, Sample

RUN = "r1"


def _put(inbox, version, worker, seq, task="t1", private=None):
    """A worker's batch in the inbox; signed with `private` when given. Its
    tokens differ by (version, seq): the same episodes twice are a replay."""
    ep = EpisodeRecord([1 + seq % 8, 2 + version % 8], [True, True], [-0.1, -0.2], "done")
    batch = RolloutBatch(worker, version, seq, [GroupRecord(task, [ep, ep])])
    key = keys.rollout_key(version, worker, seq)
    data = encode_batch(batch)
    inbox.put(key, data if private is None else sign(private, RUN, key, data))


def _rebuild(group, version):
    if group.task_id == "bad":
        raise Rejected("bad task")
    return [Sample(group.task_id, version, 1, [0, 1, 2], [True, True], [-0.1, -0.2], None)] * 2


class Asked:
    """A collector's `stop`: true from its `n`-th call on; counts the calls
    (one a round that found too few groups), so a wait is a count of rounds."""

    def __init__(self, n: int):
        self.n, self.calls = n, 0

    def __call__(self, taken: int) -> bool:
        self.calls += 1
        return self.calls >= self.n


def test_window_consumption_and_stale_counting(tmp_path):
    store = LocalStore(tmp_path)
    for v in range(4):
        _put(store, v, "w1", v)
    _put(store, 3, "w2", 0, task="bad")
    store.put(keys.rollout_key(3, "w3", 0), b"garbage")
    c = Collector(store, RUN, _rebuild, vocab=10, max_tokens=8, max_lag=1, poll_seconds=0.01)
    got = c.collect(3, need=3, stop=Asked(2))  # only two good groups exist
    assert sorted(g[0].version for g in got.groups) == [2, 3]
    assert dict(got.staleness) == {1: 1, 0: 1}
    assert c.counts["batches_dropped_stale"] == 2  # v0 and v1
    # The garbage object, and the batch whose only group failed its replay.
    assert c.counts["groups_rejected"] == 1 and c.counts["batches_rejected"] == 2
    assert c.counts["rejected_schema"] == 1 and c.counts["rejected_groups"] == 1
    assert sorted(got.rejected) == [keys.rollout_key(3, w, 0) for w in ("w2", "w3")]
    # An open run keeps counters only for workers with a group accepted.
    assert c.per_worker["w1"]["groups"] == 2 and "w2" not in c.per_worker
    # Nothing is taken twice: the next collection waits for new batches.
    asked = Asked(3)
    again = c.collect(3, need=1, stop=asked)
    assert again.groups == [] and asked.calls == 3  # it went on looking until told to stop
    _put(store, 3, "w1", 9, task="t9")
    found = Asked(1)
    assert len(c.collect(3, need=1, stop=found).groups) == 1 and found.calls == 0
    # A collector that starts from the persisted keys skips them too.
    c2 = Collector(store, RUN, _rebuild, 10, 8, 1, 0.01, consumed=set(c.consumed))
    assert c2.collect(3, need=1, stop=Asked(2)).groups == []


def test_episodes_already_trained_and_relabelled_newer_are_a_replay(tmp_path):
    # An attacker re-sends its accepted episodes under a newer version (and
    # another sequence number, re-encoded): the content is the same, so the
    # group is refused as a replay and nothing trains twice.
    store = LocalStore(tmp_path)
    ep = EpisodeRecord([3, 4, 5], [True, True, True], [-0.1, -0.2, -0.3], "done")
    first = RolloutBatch("w1", 2, 0, [GroupRecord("t1", [ep, ep])])
    store.put(keys.rollout_key(2, "w1", 0), encode_batch(first))
    c = Collector(store, RUN, _rebuild, vocab=10, max_tokens=8, max_lag=1, poll_seconds=0.01)
    assert len(c.collect(2, need=1, stop=Asked(2)).groups) == 1
    relabelled = RolloutBatch("w1", 3, 7, [GroupRecord("t1", [ep, ep])])
    store.put(keys.rollout_key(3, "w1", 7), encode_batch(relabelled))
    got = c.collect(3, need=1, stop=Asked(2))
    assert got.groups == [] and got.rejected == [keys.rollout_key(3, "w1", 7)]
    assert c.counts["groups_replayed"] == 1 and c.counts["rejected_replay"] == 1
    # Other tokens for the same task are new content.
    other = EpisodeRecord([3, 4, 6], [True, True, True], [-0.1, -0.2, -0.3], "done")
    store.put(
        keys.rollout_key(3, "w1", 8),
        encode_batch(RolloutBatch("w1", 3, 8, [GroupRecord("t1", [other, ep])])),
    )
    assert len(c.collect(3, need=1, stop=Asked(2)).groups) == 1


def test_take_order_newest_first_workers_in_turn():
    fresh = {
        2: [keys.rollout_key(2, "a", 0)],
        3: [keys.rollout_key(3, w, s) for w, s in [("a", 0), ("a", 1), ("a", 2), ("b", 0)]],
    }
    order = [keys.parse_rollout_key(k) for k in take_order(fresh)]
    assert order == [(3, "a", 0), (3, "b", 0), (3, "a", 1), (3, "a", 2), (2, "a", 0)]
    assert take_order({}) == [] and take_order({1: []}) == []
    # The window's oldest version first: no later step could take it.
    order = [keys.parse_rollout_key(k) for k in take_order(fresh, expiring=2)]
    assert order == [(2, "a", 0), (3, "a", 0), (3, "b", 0), (3, "a", 1), (3, "a", 2)]


def test_collector_stops_waiting_when_asked(tmp_path, monkeypatch):
    import colonnade.train.collect as collect

    naps = []
    monkeypatch.setattr(collect.time, "sleep", naps.append)
    c = Collector(LocalStore(tmp_path), RUN, _rebuild, 10, 8, 1, poll_seconds=0.01)
    asked = Asked(1)
    got = c.collect(0, need=1, stop=asked)
    assert got.groups == [] and asked.calls == 1 and naps == []  # not one nap after the word


def test_quarantined_workers_are_refused_and_samples_name_their_worker(tmp_path):
    # A signed run: registered workers have counters of their own.
    store = LocalStore(tmp_path)
    ring = {w: Ed25519PrivateKey.generate() for w in ("good", "bad")}
    _put(store, 0, "good", 0, private=ring["good"])
    _put(store, 0, "bad", 0, private=ring["bad"])
    c = Collector(store, RUN, _rebuild, 10, 8, 1, 0.01, quarantined={"bad"},
                  keyring={w: k.public_key() for w, k in ring.items()})  # fmt: skip
    got = c.collect(0, need=2, stop=Asked(2))
    assert len(got.groups) == 1 and all(s.worker == "good" for s in got.groups[0])
    assert c.counts["rejected_quarantined"] == 1 and c.per_worker["bad"]["batches_rejected"] == 1


def test_an_open_run_keeps_no_counters_for_a_worker_never_accepted(tmp_path):
    # Without a keyring anyone may write under any name: junk under fresh
    # names grows no per-worker state, until a group of that worker is accepted.
    store = LocalStore(tmp_path)
    _put(store, 0, "good", 0)
    _put(store, 0, "bad", 0)
    c = Collector(store, RUN, _rebuild, 10, 8, 1, 0.01, quarantined={"bad"})
    got = c.collect(0, need=2, stop=Asked(2))
    assert len(got.groups) == 1 and all(s.worker == "good" for s in got.groups[0])
    assert c.counts["rejected_quarantined"] == 1
    assert "bad" not in c.per_worker and c.per_worker["good"]["groups"] == 1


def test_a_long_wait_of_fast_polls_keeps_polling(tmp_path, monkeypatch):
    # Short versions make short polls: thousands of them in a long wait
    # once overflowed the backoff (2**polls as a float) and killed the trainer.
    import colonnade.train.collect as collect

    naps = []
    monkeypatch.setattr(collect.time, "sleep", naps.append)
    c = Collector(LocalStore(tmp_path), RUN, _rebuild, 10, 8, 1, poll_seconds=0.01)
    c.version_gap = 0.05
    asks = iter(range(1, 3000))
    got = c.collect(0, need=2, stop=lambda taken: next(asks) >= 2000)
    assert got.groups == [] and len(naps) == 1999 and max(naps) <= 0.02


def test_a_batch_must_fulfil_its_workers_claim_and_pass_the_draws(tmp_path):
    from colonnade.protocol.documents import Claim, seal_claim

    store = LocalStore(tmp_path)
    for slot, who in ((0, "w1"), (1, "w2")):
        key = keys.claim_key(2, slot)
        store.put(key, seal_claim(None, RUN, key, Claim(who, 0.0)))

    def batch(worker, seq, slot, task):
        ep = EpisodeRecord([1, 2], [True, True], [-0.1, -0.2], "done")
        b = RolloutBatch(worker, 2, seq, [GroupRecord(task, [ep, ep])], slot=slot)
        store.put(keys.rollout_key(2, worker, seq), encode_batch(b))

    batch("w1", 0, 0, "ok")  # its own claim, draws that pass
    batch("w1", 1, 1, "ok")  # w2's slot
    batch("w1", 2, 7, "ok")  # a slot nobody claimed
    batch("w2", 0, 1, "forged")  # its claim, draws that do not pass
    batch("w2", 1, 1, "ok")  # after a proven forgery: refused
    checked = []

    def check(b):
        checked.append((b.worker, b.seq))
        return "2 of 2 sampled tokens fall outside" if b.groups[0].task_id == "forged" else None

    c = Collector(store, RUN, _rebuild, 10, 8, 1, 0.01, check_draws=check)
    got = c.collect(2, need=5, stop=Asked(2))
    assert [k for k in got.keys] == [keys.rollout_key(2, "w1", 0)]
    assert c.counts["rejected_unclaimed"] == 2 and c.counts["rejected_forged"] == 1
    assert c.counts["rejected_quarantined"] == 1
    assert c.forged == {"w2": "2 of 2 sampled tokens fall outside"} and "w2" in c.quarantined
    assert sorted(checked) == [("w1", 0), ("w2", 0)]  # claims first: the draws only then
