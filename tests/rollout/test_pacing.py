"""Worker pacing: no batches of a version beyond a step's worth of its groups."""

from types import SimpleNamespace

import pytest

import colonnade.rollout.worker as worker_module
from colonnade.config import WorkerConfig
from colonnade.protocol import RunSpec, keys
from colonnade.protocol.documents import Quarantine, QuarantineDecision
from colonnade.protocol.polling import moving_gap, poll_interval
from colonnade.protocol.schemas import Latest, VersionMeta, dumps
from colonnade.rollout.worker import Quarantined, Worker, pace_quota
from colonnade.store import LocalStore
from colonnade.store.counting import Counting


def _worker(tmp_path, pace_seconds=5.0, groups_per_step=4, max_lag=0):
    store = LocalStore(tmp_path / "run")
    w = Worker(WorkerConfig(id="w1", pace_seconds=pace_seconds, poll_seconds=0.1), store)
    w.spec = RunSpec("r", "smoke", {}, [], 10, "int8", 4, 2, max_lag, 10, {},
                     groups_per_step=groups_per_step)  # fmt: skip
    w.follower = SimpleNamespace(version=3)
    return w, store


def _batch(store, v, worker, seq):
    store.put(keys.rollout_key(v, worker, seq), b"x")


def _publish(store, v):
    h = "blake3:" + "0" * 64
    meta = VersionMeta(v, v, h, 1, 0.0, int(v > 0), h if v else "", 1, h)
    store.put(keys.meta_key(v), meta.to_json())
    store.put(keys.LATEST, Latest(v, meta).to_json())


class Clock:
    """Stands in for the worker's `time` module: a sleep moves the clock on
    at once, so a wait is counted in polls, not measured."""

    def __init__(self):
        self.now = 0.0
        self.naps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    perf_counter = monotonic

    def time(self) -> float:
        return 1.7e9 + self.now

    def sleep(self, seconds: float) -> None:
        self.naps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(worker_module, "time", c)
    return c


class PublishOnPoll(Counting):
    """Counts requests; publishes `version` when latest.json is read the `at`-th time."""

    def __init__(self, inner, version: int, at: int):
        super().__init__(inner)
        self.version, self.at, self.polls = version, at, 0

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if key == keys.LATEST:
            self.polls += 1
            if self.polls == self.at:
                _publish(self.inner, self.version)
        return super().get(key, max_bytes=max_bytes)


def test_quota_counts_every_workers_batches_of_the_version(tmp_path):
    w, store = _worker(tmp_path)
    _batch(store, 2, "w2", 0)  # an older version does not count
    _batch(store, 2, "w2", 1)
    _batch(store, 3, "w1", 0)
    assert not w.quota_full()  # 1 batch x 2 groups < 4
    _batch(store, 3, "w2", 0)
    assert w.quota_full()


def test_with_stale_groups_usable_the_fleet_makes_two_steps_of_a_version(tmp_path):
    assert (pace_quota(8, 0), pace_quota(8, 1), pace_quota(8, 2), pace_quota(0, 2)) == (
        8,
        16,
        16,
        0,
    )
    w, store = _worker(tmp_path, max_lag=2)
    for seq in range(3):
        _batch(store, 3, "w2", seq)
    assert not w.quota_full()  # 3 batches x 2 groups < 2 x 4
    _batch(store, 3, "w1", 0)
    assert w.quota_full()


def test_no_pacing_when_off_or_when_the_run_does_not_say_its_step(tmp_path):
    for w, store in (_worker(tmp_path / "a", pace_seconds=0), _worker(tmp_path / "b", 5.0, 0)):
        _batch(store, 3, "w1", 0)
        _batch(store, 3, "w2", 0)
        assert not w.quota_full()


def test_a_paced_worker_moves_on_when_a_newer_version_appears(tmp_path, clock):
    w, store = _worker(tmp_path, pace_seconds=30.0)
    _publish(store, 3)
    w.store = polled = PublishOnPoll(store, version=4, at=3)  # v4 shows at the third poll
    assert w.wait_for_newer()
    assert polled.polls == 3 and w.pointer.version == 4  # it stopped at the poll that saw v4
    # The wait is counted as paced time: three polls' worth.
    assert len(clock.naps) == 3 and w.pending_time["paced_seconds"] == pytest.approx(clock.now)


def test_a_paced_worker_gives_up_waiting_after_pace_seconds(tmp_path, clock):
    w, store = _worker(tmp_path, pace_seconds=0.5)
    _publish(store, 3)
    assert not w.wait_for_newer()  # the quota's batches were refused: make one anyway
    # It polled until pace_seconds had passed, and not one poll longer.
    assert clock.now >= 0.5 and clock.now - clock.naps[-1] < 0.5
    assert w.pending_time["paced_seconds"] == pytest.approx(clock.now)


def test_a_stop_or_the_runs_end_ends_the_wait(tmp_path):
    w, store = _worker(tmp_path, pace_seconds=30.0)
    _publish(store, 3)
    latest = Latest.from_json(store.get(keys.LATEST))
    store.put(keys.LATEST, Latest(3, latest.meta, done=True).to_json())  # the run's end
    assert w.wait_for_newer() and w.done()
    store.put(keys.LATEST, latest.to_json())
    w.stop.requested = True
    assert w.wait_for_newer()


def test_batches_of_quarantined_workers_fill_no_quota(tmp_path):
    w, store = _worker(tmp_path)
    _batch(store, 3, "liar", 0)
    _batch(store, 3, "liar", 1)
    store.put(
        keys.QUARANTINE, Quarantine({"liar": QuarantineDecision("mismatch KL", 2, 1.0)}).to_json()
    )
    w.refused = w.read_quarantine()
    assert w.refused == {"liar"} and not w.quota_full()
    _batch(store, 3, "w2", 0)
    _batch(store, 3, "w2", 1)
    assert w.quota_full()


def test_a_quarantined_worker_learns_it_and_says_why(tmp_path):
    w, store = _worker(tmp_path)
    assert w.read_quarantine() == set()  # no decisions yet
    store.put(keys.QUARANTINE, b"not json")
    assert w.read_quarantine() == set()
    store.put(keys.QUARANTINE, dumps({"w1": {"reason": "mismatch KL", "version": 4}}))
    assert w.read_quarantine() == set()  # not a decision (no time): not read
    decision = QuarantineDecision("mismatch KL 0.9/token", 4, 1.0)
    store.put(keys.QUARANTINE, Quarantine({"w1": decision}).to_json())
    with pytest.raises(Quarantined, match=r"quarantined worker w1 \(mismatch KL 0\.9/token\)"):
        w.read_quarantine()


def test_polls_follow_the_time_between_versions():
    assert poll_interval(None, 1.0) == 0.05  # nothing seen yet: look soon
    assert poll_interval(0.3, 1.0) == pytest.approx(0.03)  # smoke: a tenth of a step
    assert poll_interval(0.05, 1.0) == 0.02  # never more than 50 times a second
    assert poll_interval(60.0, 1.0) == 1.0  # a slow trainer: every poll_seconds
    assert poll_interval(None, 0.01) == 0.01
    assert moving_gap(None, 2.0) == 2.0
    assert moving_gap(2.0, 1.0) == pytest.approx(1.8)


def test_a_waiting_worker_makes_one_request_a_poll(tmp_path, clock):
    w, store = _worker(tmp_path, pace_seconds=0.5)
    _publish(store, 3)
    w.store = counting = Counting(store)
    assert not w.wait_for_newer()
    # latest.json once a nap, nothing else
    assert dict(counting.counts) == {"get": len(clock.naps)} and len(clock.naps) >= 2
