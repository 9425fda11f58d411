"""Worker pacing by the trainer's demand: claim a slot of the running
version, or wait, at the pace of the versions, for latest.json to change."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

import colonnade.rollout.worker as worker_module
from colonnade.config import WorkerConfig
from colonnade.protocol import RunSpec, keys
from colonnade.protocol.documents import Claim, Quarantine, QuarantineDecision
from colonnade.protocol.polling import idle_delay, moving_gap, poll_interval
from colonnade.protocol.schemas import Demand, Latest, VersionMeta, dumps
from colonnade.rollout.worker import CLAIM_TRIES, Quarantined, Worker
from colonnade.store import LocalStore
from colonnade.store.counting import Counting


def _worker(tmp_path, running=3):
    store = LocalStore(tmp_path / "run")
    w = Worker(WorkerConfig(id="w1", poll_seconds=0.1), store)
    w.spec = RunSpec("r", "smoke", {}, [], 10, "int8", 4, 2, 2, 10, {}, groups_per_step=4)
    w.follower = SimpleNamespace(version=running)
    return w, store


def _publish(store, v, slots=0, demand_version=None):
    h = "blake3:" + "0" * 64
    meta = VersionMeta(v, v, h, 1, 0.0, int(v > 0), h if v else "", 1, h)
    demand = Demand(v if demand_version is None else demand_version, slots, max(0, v - 2), 60.0)
    store.put(keys.meta_key(v), meta.to_json())
    store.put(keys.LATEST, Latest(v, meta, demand=demand).to_json())


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


def test_a_worker_claims_a_slot_of_its_version_only(tmp_path):
    w, store = _worker(tmp_path)
    _publish(store, 3, slots=2, demand_version=4)  # slots of a version it does not run
    w._poll()
    assert not w.claim() and store.list(keys.CLAIMS) == []
    _publish(store, 3, slots=2)
    w._poll()
    assert w.claim() and w.claim()  # one slot per batch
    assert not w.claim()  # both taken: by this worker, as it happens
    held = [Claim.from_json(store.get(k)) for k in store.list(keys.claims_dir(3))]
    assert [c.worker for c in held] == ["w1", "w1"] and w.claims == 2


def test_a_taken_slot_is_tried_once_and_a_look_costs_a_few_requests(tmp_path):
    w, store = _worker(tmp_path)
    _publish(store, 3, slots=6)
    for slot in range(5):  # other workers were first to five of the six
        store.put_if_absent(keys.claim_key(3, slot), Claim("other", 1.0).to_json())
    w._poll()
    w.store = counting = Counting(store)
    tries = 0
    while not w.claim():
        tries += 1
    # At most CLAIM_TRIES put-if-absent a look, and never the same slot twice.
    assert counting.counts["put_if_absent"] <= 6 and tries <= 6 // CLAIM_TRIES
    assert set(counting.counts) == {"put_if_absent"}
    assert not w.claim() and counting.counts["put_if_absent"] <= 6  # nothing left to try


def test_an_idle_worker_moves_on_when_a_newer_version_appears(tmp_path, clock):
    w, store = _worker(tmp_path)
    _publish(store, 3)
    w._poll()
    w.store = polled = PublishOnPoll(store, version=4, at=3)  # v4 shows at the third poll
    w.wait_for_work()
    assert polled.polls == 3 and w.pointer.version == 4  # it stopped at the poll that saw v4
    # The wait is counted as paced time.
    assert w.pending_time["paced_seconds"] == pytest.approx(clock.now)


def test_new_slots_the_runs_end_or_a_stop_end_the_wait(tmp_path, clock):
    w, store = _worker(tmp_path)
    _publish(store, 3, slots=1)
    w._poll()
    _publish(store, 3, slots=3)  # a claim lapsed: more slots of the same version
    w.wait_for_work()
    assert w.pointer.demand.slots == 3
    latest = Latest.from_json(store.get(keys.LATEST))
    store.put(keys.LATEST, Latest(3, latest.meta, done=True).to_json())  # the run's end
    w.wait_for_work()
    assert w.done()
    store.put(keys.LATEST, latest.to_json())
    w.stop.requested = True
    w.wait_for_work()  # returns at once


class PublishAt(Counting):
    """Counts requests; v4 is out from clock time `at` on."""

    def __init__(self, inner, clock, at: float):
        super().__init__(inner)
        self.clock, self.at, self.polls = clock, at, 0

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        if key == keys.LATEST:
            self.polls += 1
            if self.clock.now >= self.at:
                _publish(self.inner, 4)
        return super().get(key, max_bytes=max_bytes)


def test_an_idle_worker_looks_a_few_times_a_version_however_long_it_takes(tmp_path, clock):
    for gap in (0.3, 60.0):
        w, store = _worker(tmp_path / str(gap))
        _publish(store, 3)
        w._poll()
        w.version_gap, w._synced_at = gap, clock.now  # it has just installed v3
        w.store = polled = PublishAt(store, clock, at=clock.now + gap)  # v4 on time
        w.wait_for_work()
        # One look when the version is about due, then a tenth of the interval.
        assert w.pointer.version == 4 and 2 <= polled.polls <= 3, (gap, polled.polls)
        assert set(polled.counts) == {"get"}


def test_a_joiner_paces_its_first_wait_by_the_trainers_interval(tmp_path, clock):
    w, store = _worker(tmp_path)
    _publish(store, 3)
    meta = replace(w._poll().meta, created=clock.time() - 30.0)  # v3 came 30 s ago
    store.put(keys.LATEST, Latest(3, meta, demand=w.pointer.demand, version_seconds=60.0).to_json())
    w._poll()
    w._synced_at = clock.now  # it has just installed v3, the first version it saw
    assert w.version_gap is None and w.pace() == 60.0
    w.store = polled = PublishAt(store, clock, at=clock.now + 30.0)  # v4 on time
    w.wait_for_work()
    # Without the hint it would have looked ~35 times (doubling from 0.05 s to 1 s);
    # timed from its own install, not v3's publication, it would have slept past v4.
    assert w.pointer.version == 4 and 2 <= polled.polls <= 3, polled.polls
    assert clock.now < 30.0 + 6.0 + 1e-6  # woke within a tenth of the interval of v4
    w.version_gap = 5.0
    assert w.pace() == 5.0  # its own measure wins once it has one
    w.version_gap = None
    w.pointer = replace(w.pointer, version_seconds=80_000.0)
    assert w.pace() == worker_module.HINT_SECONDS  # another's word, believed only so far


def test_idle_delays_follow_the_version_interval():
    assert idle_delay(None, 0.0, 0, 1.0) == 0.05  # nothing seen yet: look soon...
    assert idle_delay(None, 0.0, 3, 1.0) == 0.4  # ...then less often
    assert idle_delay(None, 0.0, 10, 1.0) == 1.0  # up to poll_seconds
    assert idle_delay(60.0, 0.0, 0, 1.0) == pytest.approx(48.0)  # asleep until about due
    assert idle_delay(60.0, 50.0, 1, 1.0) == pytest.approx(6.0)  # then a tenth
    assert idle_delay(0.1, 0.2, 1, 1.0) == 0.02  # never more than 50 a second


class _Outage:
    """The store under a worker: put_if_absent fails `n` times (after writing
    the object when `lands`, as a put whose answer was lost), then works."""

    def __init__(self, store, n, lands):
        self.store, self.n, self.lands = store, n, lands

    def __getattr__(self, name):
        return getattr(self.store, name)

    def put_if_absent(self, key, data):
        from colonnade.store.errors import StoreUnavailable

        if self.n > 0:
            self.n -= 1
            if self.lands:
                self.store.put_if_absent(key, data)
            raise StoreUnavailable(f"outage: {key}")
        return self.store.put_if_absent(key, data)


@pytest.mark.parametrize("lands", [False, True], ids=["lost", "landed"])
def test_a_claim_that_failed_in_an_outage_is_not_lost(tmp_path, lands):
    from colonnade.store import StoreError

    w, store = _worker(tmp_path)
    _publish(store, 3, slots=1)
    w._poll()
    w.store = _Outage(store, 3, lands)
    for _ in range(3):
        with pytest.raises(StoreError):
            w.claim()
    # The store is back: the one slot is still this worker's to make, whether
    # the failed puts wrote it or not (no wait for a demand that never changes).
    assert w.claim() and w.claims == 1
    assert not w.claim()  # and only once
    held = [Claim.from_json(store.get(k)).worker for k in store.list(keys.claims_dir(3))]
    assert held == ["w1"]


def test_a_slot_another_worker_holds_is_not_taken_for_ones_own(tmp_path):
    w, store = _worker(tmp_path)
    _publish(store, 3, slots=1)
    w._poll()
    store.put_if_absent(keys.claim_key(3, 0), Claim("other", 1.0).to_json())
    w.unsure.add(keys.claim_key(3, 0))  # even after a failed put of its own
    assert not w.claim()
