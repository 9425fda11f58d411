"""Worker pacing by the trainer's demand: claim a slot of the running
version, or wait, at the pace of the versions, for latest.json to change."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

import colonnade.rollout.pacing as pacing_module
import colonnade.rollout.watch as watch_module
from colonnade.config import WorkerConfig
from colonnade.protocol import keys
from colonnade.protocol.documents import (
    Claim,
    Quarantine,
    QuarantineDecision,
    open_claim,
    seal_claim,
    sealed,
)
from colonnade.protocol.polling import idle_delay, moving_gap, poll_interval
from colonnade.protocol.reader import open_run
from colonnade.protocol.schemas import Demand, Latest, VersionMeta
from colonnade.protocol.signing import Signer
from colonnade.rollout.claims import CLAIM_TRIES
from colonnade.rollout.worker import Quarantined, Worker
from colonnade.store import LocalStore
from colonnade.store.counting import Counting

RUN = "r"
SIGNERS: dict[str, Signer] = {}  # store url -> the trainer's signer of the run there


@pytest.fixture
def run(signed_run):
    """make(path) -> the run store of a signed run (v3 running) under `path`."""

    def make(path):
        store = LocalStore(path)
        SIGNERS[store.url] = signed_run(store, RUN, vocab_size=10, max_lag=2, groups_per_step=4)
        return store

    yield make
    SIGNERS.clear()


def _worker(run, path, running=3):
    """A worker that joined the run under `path` (run.json read, its key
    pinned) and runs version `running`; (worker, run store, inbox)."""
    store = run(path / "run")
    w = Worker(WorkerConfig(id="w1", poll_seconds=0.1), store)
    view = open_run(store)
    w.wire(view.spec, view.trust, view.inbox, loader=None)
    w.weights.follower = SimpleNamespace(version=running)  # no engine: it runs the follower's
    return w, store, view.inbox


def _seal(store, key, doc) -> bytes:
    return sealed(SIGNERS[store.url], key, doc)


def _publish(store, v, slots=0, demand_version=None):
    h = "blake3:" + "0" * 64
    meta = VersionMeta(v, v, h, 1, 0.0, int(v > 0), h if v else "", 1, h)
    demand = Demand(v if demand_version is None else demand_version, slots, max(0, v - 2), 60.0)
    store.put(keys.meta_key(v), _seal(store, keys.meta_key(v), meta))
    store.put(keys.LATEST, _seal(store, keys.LATEST, Latest(v, meta, demand=demand)))


def _latest(store) -> Latest:
    trust = SIGNERS[store.url].trust
    return Latest.from_dict(trust.open(keys.LATEST, store.get(keys.LATEST)))


def _claim(key, worker) -> bytes:
    """A claim as a worker of an open run writes it (unsigned)."""
    return seal_claim(None, RUN, key, Claim(worker, 1.0))


def _holders(inbox, v) -> list[str]:
    return [open_claim(inbox.get(k), k, RUN, None).worker for k in inbox.list(keys.claims_dir(v))]


class Clock:
    """Stands in for the `time` module of the worker's waits: a sleep moves
    the clock on at once, so a wait is counted in polls, not measured."""

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
    monkeypatch.setattr(pacing_module, "time", c)
    monkeypatch.setattr(watch_module, "time", c)
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


def test_a_quarantined_worker_learns_it_and_says_why(tmp_path, run):
    w, store, _ = _worker(run, tmp_path)
    assert w.watch.read_quarantine() == set()  # no decisions yet
    store.put(keys.QUARANTINE, b"not json")
    assert w.watch.read_quarantine() == set()
    not_a_decision = {"w1": {"reason": "mismatch KL", "version": 4}}  # no time
    store.put(keys.QUARANTINE, SIGNERS[store.url].seal(keys.QUARANTINE, not_a_decision))
    assert w.watch.read_quarantine() == set()  # signed, but not a decision: not read
    decision = QuarantineDecision("mismatch KL 0.9/token", 4, 1.0)
    doc = Quarantine({"w1": decision})
    store.put(keys.QUARANTINE, doc.to_json())  # anyone's: not signed by the trainer
    assert w.watch.read_quarantine() == set()
    forger = Signer(Ed25519PrivateKey.generate(), RUN)
    store.put(keys.QUARANTINE, sealed(forger, keys.QUARANTINE, doc))  # another key
    assert w.watch.read_quarantine() == set()
    assert w.tally.counts["unverified"] == 4  # each counted, none acted on
    store.put(keys.QUARANTINE, _seal(store, keys.QUARANTINE, doc))
    with pytest.raises(Quarantined, match=r"quarantined worker w1 \(mismatch KL 0\.9/token\)"):
        w.watch.read_quarantine()


def test_a_latest_json_the_trainer_did_not_sign_is_not_acted_on(tmp_path, run):
    w, store, _ = _worker(run, tmp_path)
    _publish(store, 3, slots=2)
    assert w.watch.poll().version == 3
    forged = _latest(store)
    forged = Latest(forged.version, forged.meta, done=True)  # "the run is over"
    store.put(keys.LATEST, forged.to_json())  # unsigned
    assert w.watch.poll() is None and not w.watch.done() and w.tally.counts["unverified"] == 1
    forger = Signer(Ed25519PrivateKey.generate(), RUN)
    store.put(keys.LATEST, sealed(forger, keys.LATEST, forged))
    assert w.watch.poll() is None and not w.watch.done() and w.tally.counts["unverified"] == 2
    # The trainer's own pointer to an older version is no step back either.
    _publish(store, 4, slots=2)
    assert w.watch.poll().version == 4
    _publish(store, 3, slots=2)
    assert w.watch.poll() is None and w.watch.latest.version == 4


def test_polls_follow_the_time_between_versions():
    assert poll_interval(None, 1.0) == 0.05  # nothing seen yet: look soon
    assert poll_interval(0.3, 1.0) == pytest.approx(0.03)  # smoke: a tenth of a step
    assert poll_interval(0.05, 1.0) == 0.02  # never more than 50 times a second
    assert poll_interval(60.0, 1.0) == 1.0  # a slow trainer: every poll_seconds
    assert poll_interval(None, 0.01) == 0.01
    assert moving_gap(None, 2.0) == 2.0
    assert moving_gap(2.0, 1.0) == pytest.approx(1.8)


def test_a_worker_claims_a_slot_of_its_version_only(tmp_path, run):
    w, store, inbox = _worker(run, tmp_path)
    _publish(store, 3, slots=2, demand_version=4)  # slots of a version it does not run
    w.watch.poll()
    assert not w.claim() and inbox.list(keys.CLAIMS) == []
    _publish(store, 3, slots=2)
    w.watch.poll()
    assert w.claim() and w.claim()  # one slot per batch
    assert not w.claim()  # both taken: by this worker, as it happens
    assert _holders(inbox, 3) == ["w1", "w1"] and w.claims.count == 2
    assert store.list(keys.CLAIMS) == []  # claims go to the inbox, not the run's store


def test_a_taken_slot_is_never_tried_and_a_look_costs_a_few_requests(tmp_path, run):
    w, store, inbox = _worker(run, tmp_path)
    _publish(store, 3, slots=6)
    for slot in range(5):  # other workers were first to five of the six
        inbox.put_if_absent(keys.claim_key(3, slot), _claim(keys.claim_key(3, slot), "other"))
    w.watch.poll()
    w.claims.inbox = counting = Counting(inbox)
    # One listing of the version's claims tells which slots are taken: the
    # free one is the one tried.
    assert w.claim()
    assert counting.counts == {"list": 1, "put_if_absent": 1}
    assert _holders(inbox, 3) == ["other"] * 5 + ["w1"]
    # Nothing left: no look at the store at all.
    assert not w.claim() and counting.counts == {"list": 1, "put_if_absent": 1}


def test_a_look_tries_a_few_slots_at_most(tmp_path, run, monkeypatch):
    # Slots that others take between the listing and the try: at most
    # CLAIM_TRIES put-if-absent a look, and never the same slot twice.
    w, store, inbox = _worker(run, tmp_path)
    _publish(store, 3, slots=6)
    w.watch.poll()

    class Racing(Counting):
        def put_if_absent(self, key, data):
            self.inner.put_if_absent(key, _claim(key, "other"))  # someone was first
            return super().put_if_absent(key, data)

    w.claims.inbox = racing = Racing(inbox)
    looks = 0
    while w.free_slots():
        assert not w.claim()
        looks += 1
    assert racing.counts["put_if_absent"] == 6 and looks == 6 // CLAIM_TRIES
    assert racing.counts["list"] == looks and not w.claim()


def test_an_idle_worker_moves_on_when_a_newer_version_appears(tmp_path, clock, run):
    w, store, _ = _worker(run, tmp_path)
    _publish(store, 3)
    w.watch.poll()
    w.watch.store = polled = PublishOnPoll(store, version=4, at=3)  # v4 shows at the third poll
    w.pacer.wait(w.running_version)
    assert polled.polls == 3 and w.watch.latest.version == 4  # it stopped at the poll that saw v4
    # The wait is counted as paced time.
    assert w.tally.seconds["paced_seconds"] == pytest.approx(clock.now)


def test_new_slots_the_runs_end_or_a_stop_end_the_wait(tmp_path, clock, run):
    w, store, _ = _worker(run, tmp_path)
    _publish(store, 3, slots=1)
    w.watch.poll()
    _publish(store, 3, slots=3)  # a claim lapsed: more slots of the same version
    w.pacer.wait(w.running_version)
    assert w.watch.latest.demand.slots == 3
    latest = _latest(store)
    store.put(keys.LATEST, _seal(store, keys.LATEST, Latest(3, latest.meta, done=True)))  # the end
    w.pacer.wait(w.running_version)
    assert w.watch.done()
    store.put(keys.LATEST, _seal(store, keys.LATEST, latest))
    w.stop.requested = True
    w.pacer.wait(w.running_version)  # returns at once


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


def test_an_idle_worker_looks_a_few_times_a_version_however_long_it_takes(tmp_path, clock, run):
    for gap in (0.3, 60.0):
        w, store, _ = _worker(run, tmp_path / str(gap))
        _publish(store, 3)
        w.watch.poll()
        w.pacer.version_gap, w.pacer.synced_at = gap, clock.now  # it has just installed v3
        w.watch.store = polled = PublishAt(store, clock, at=clock.now + gap)  # v4 on time
        w.pacer.wait(w.running_version)
        # One look when the version is about due, then a tenth of the interval.
        assert w.watch.latest.version == 4 and 2 <= polled.polls <= 3, (gap, polled.polls)
        assert set(polled.counts) == {"get"}


def test_a_joiner_paces_its_first_wait_by_the_trainers_interval(tmp_path, clock, run):
    w, store, _ = _worker(run, tmp_path)
    _publish(store, 3)
    meta = replace(w.watch.poll().meta, created=clock.time() - 30.0)  # v3 came 30 s ago
    latest = Latest(3, meta, demand=w.watch.latest.demand, version_seconds=60.0)
    store.put(keys.LATEST, _seal(store, keys.LATEST, latest))
    w.watch.poll()
    w.pacer.synced_at = clock.now  # it has just installed v3, the first version it saw
    assert w.pacer.version_gap is None and w.pacer.pace() == 60.0
    w.watch.store = polled = PublishAt(store, clock, at=clock.now + 30.0)  # v4 on time
    w.pacer.wait(w.running_version)
    # Without the hint it would have looked ~35 times (doubling from 0.05 s to 1 s);
    # timed from its own install, not v3's publication, it would have slept past v4.
    assert w.watch.latest.version == 4 and 2 <= polled.polls <= 3, polled.polls
    assert clock.now < 30.0 + 6.0 + 1e-6  # woke within a tenth of the interval of v4
    w.pacer.version_gap = 5.0
    assert w.pacer.pace() == 5.0  # its own measure wins once it has one
    w.pacer.version_gap = None
    w.watch.latest = replace(w.watch.latest, version_seconds=80_000.0)
    assert w.pacer.pace() == pacing_module.HINT_SECONDS  # another's word, believed only so far


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
def test_a_claim_that_failed_in_an_outage_is_not_lost(tmp_path, lands, run):
    from colonnade.store import StoreError

    w, store, inbox = _worker(run, tmp_path)
    _publish(store, 3, slots=1)
    w.watch.poll()
    w.claims.inbox = _Outage(inbox, 3, lands)
    for _ in range(3):
        with pytest.raises(StoreError):
            w.claim()
    # The store is back: the one slot is still this worker's to make, whether
    # the failed puts wrote it or not (no wait for a demand that never changes).
    assert w.claim() and w.claims.count == 1
    assert not w.claim()  # and only once
    assert _holders(inbox, 3) == ["w1"]


def test_a_slot_another_worker_holds_is_not_taken_for_ones_own(tmp_path, run):
    w, store, inbox = _worker(run, tmp_path)
    _publish(store, 3, slots=1)
    w.watch.poll()
    inbox.put_if_absent(keys.claim_key(3, 0), _claim(keys.claim_key(3, 0), "other"))
    w.claims.unsure.add(keys.claim_key(3, 0))  # even after a failed put of its own
    assert not w.claim()
