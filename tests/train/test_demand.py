"""Demand-driven generation: the trainer's demand, the workers' claims.

Pure parts first (horizon, wanted groups, slots, which claims are in
flight), then the planner over a LocalStore: two workers and the trainer's
pieces (planner, newest-first take) make about what the trainer takes; a
dead worker's claim lapses and its slot is made again; a resumed trainer
works out the same demand.
"""

import time
from collections import Counter
from types import SimpleNamespace

import pytest

from colonnade.config import WorkerConfig
from colonnade.protocol import keys
from colonnade.protocol.documents import Claim, sealed
from colonnade.protocol.inbox import list_inbox, scan
from colonnade.protocol.reader import open_run
from colonnade.protocol.schemas import Demand, Latest, SchemaError, VersionMeta, dumps
from colonnade.rollout.worker import Worker
from colonnade.store import LocalStore
from colonnade.train.collect import take_order
from colonnade.train.demand import (
    LEASE_FACTOR,
    MAX_LEASE_FACTOR,
    Planner,
    SeenClaim,
    claim_times,
    horizon,
    lease_for,
    new_slots,
    pending,
    wanted_groups,
)
from colonnade.train.retention import inbox_garbage

G, B = 8, 2  # groups per step, groups per batch


def test_the_horizon_is_two_steps_with_stale_groups_usable_and_ends_with_the_run():
    assert horizon(0, 40, G, max_lag=2) == 2 * G
    assert horizon(0, 40, G, max_lag=0) == G  # on-policy: only the next step
    assert horizon(39, 40, G, max_lag=2) == G  # the last step
    assert horizon(40, 40, G, max_lag=2) == 0


def test_wanted_groups_subtract_what_is_made_and_promised():
    assert wanted_groups(16, 0, 2, ready=0, promised=0) == 18  # a fresh run
    assert wanted_groups(16, 0, 2, ready=10, promised=0) == 8  # steady state: a step's worth
    assert wanted_groups(16, 0, 2, ready=10, promised=12) == 0  # never negative
    assert wanted_groups(8, 6, 0, ready=0, promised=2) == 0  # the step's shortfall is in flight
    assert wanted_groups(8, 6, 0, ready=0, promised=0) == 2
    assert wanted_groups(8, 8, 2, ready=0, promised=0) == 0  # the step has all it needs


def test_slots_only_grow_a_batch_at_a_time():
    assert new_slots(0, 18, B) == 9
    assert new_slots(4, 3, B) == 6  # a part batch is a whole slot
    assert new_slots(4, 0, B) == 4


def _c(v, slot, worker, at):
    return SeenClaim(v, slot, worker, at)


def test_a_workers_batches_fulfil_its_claims_in_order_and_only_its_newest_flies():
    claims = [_c(3, 0, "a", 1.0), _c(3, 1, "b", 2.0), _c(3, 2, "a", 3.0), _c(4, 0, "a", 4.0)]
    landed = Counter({(3, "a"): 2})
    # a: both v3 claims fulfilled, the v4 one in flight; b: in flight.
    assert pending(claims, landed, now=5.0, lease=10.0) == [_c(3, 1, "b", 2.0), _c(4, 0, "a", 4.0)]
    # The lease runs out by the claim's store time.
    assert pending(claims, landed, now=12.5, lease=10.0) == [_c(4, 0, "a", 4.0)]


def test_a_restarted_workers_old_claim_lapses_at_once():
    # a claimed slot 0, died, came back under the same id and claimed slot 3:
    # a worker holds one unfulfilled claim at most, so slot 0's batch never comes.
    claims = [_c(5, 0, "a", 1.0), _c(5, 3, "a", 2.0)]
    assert pending(claims, Counter(), now=3.0, lease=100.0) == [_c(5, 3, "a", 2.0)]
    # A claim that did not read holds nothing.
    assert pending([_c(5, 1, None, 1.0)], Counter(), now=2.0, lease=100.0) == []


def test_claim_to_batch_times_pair_a_workers_claims_and_batches_in_order():
    claims = [_c(3, 0, "a", 10.0), _c(3, 2, "a", 30.0), _c(3, 1, "b", 12.0), _c(4, 0, "a", 50.0)]
    batches = {(3, "a"): [45.0, 20.0], (3, "b"): [100.0]}  # store times, any order
    assert claim_times(claims, batches) == {(3, 0, "a"): 10.0, (3, 2, "a"): 15.0, (3, 1, "b"): 88.0}
    # A claim not yet fulfilled has no time; a claim that did not read holds none.
    assert claim_times([_c(3, 0, None, 1.0)], {(3, "a"): [2.0]}) == {}


def test_a_workers_lease_follows_its_slowest_recent_batch_within_bounds():
    base = 120.0
    assert lease_for([], base) == base  # not measured: the run's claim_seconds
    assert lease_for([5.0, 8.0], base) == base  # fast: never below the base
    assert lease_for([30.0, 200.0, 90.0], base) == LEASE_FACTOR * 200.0  # a slow Mac keeps claims
    assert lease_for([1e6], base) == MAX_LEASE_FACTOR * base  # bounded
    # pending takes each worker's lease: at age 150 s the slow worker's claim
    # still flies, the fast one's has lapsed.
    claims = [_c(3, 0, "slow", 0.0), _c(3, 1, "fast", 0.0)]
    leases = {"slow": lease_for([200.0], base), "fast": lease_for([5.0], base)}
    assert pending(claims, Counter(), now=150.0, lease=leases.__getitem__) == [claims[0]]


def test_claims_and_demand_read_only_as_their_types():
    c = Claim("w1", 1.7e9)
    assert Claim.from_json(c.to_json()) == c
    for bad in ({"worker": "w 1", "time": 1.0}, {"worker": "w1"}, {"worker": "w1", "time": -1},
                {"worker": "w1", "time": 1.0, "expires": 2.0}):  # fmt: skip
        with pytest.raises(SchemaError):
            Claim.from_json(dumps(bad))
    d = Demand(7, 5, 5, 120.0)
    h = "blake3:" + "0" * 64
    meta = VersionMeta(7, 0, h, 1, 0.0, 1, h)
    latest = Latest(7, meta, demand=d)
    assert Latest.from_json(latest.to_json()) == latest
    assert Latest.from_json(Latest(7, meta).to_json()).demand is None
    for bad in ({"version": 7, "slots": -1, "oldest": 5, "lease_seconds": 1.0},
                {"version": 7, "slots": 2, "oldest": 8, "lease_seconds": 1.0},
                {"version": 7, "slots": 2, "oldest": 5, "lease_seconds": 0}):  # fmt: skip
        with pytest.raises(SchemaError):
            Demand.from_dict(bad)


def test_claim_keys_and_retention():
    assert keys.claim_key(12, 3) == "claims/00000012/000003.json"
    assert keys.parse_claim_key("claims/00000012/000003.json") == (12, 3)
    for bad in ("claims/00000012/3.json", "claims/00000012/000003.json\n", "claims/x/000001.json"):
        assert keys.parse_claim_key(bad) is None
    with pytest.raises(ValueError):
        keys.claim_key(1, keys.MAX_SLOT + 1)
    listing = scan({"claims/00000007/000000.json": 1.0, "claims/00000008/000001.json": 1.0})
    assert inbox_garbage(listing, 9, 1) == ["claims/00000007/000000.json"]


# -- over a store: the planner, workers' claims, the trainer's take ------------------------


class Run:
    """A run's store with a signed run.json; its inbox, and the trainer's
    signer for latest.json."""

    def __init__(self, root, signed_run):
        self.store = LocalStore(root)
        self.signer = signed_run(self.store, group_size=4, groups_per_batch=B)
        self.inbox = open_run(self.store).inbox

    def latest(self, v, demand):
        h = "blake3:" + "0" * 64
        meta = VersionMeta(v, v, h, 1, 0.0, int(v > 0), h if v else "", 1, h)
        self.store.put(
            keys.LATEST, sealed(self.signer, keys.LATEST, Latest(v, meta, demand=demand))
        )

    def announced(self) -> Demand | None:
        return Latest.from_dict(
            self.signer.trust.open(keys.LATEST, self.store.get(keys.LATEST))
        ).demand

    def rollouts(self) -> list[str]:
        return sorted(k for found in list_inbox(self.inbox).rollouts.values() for k in found)

    def claims(self) -> list[str]:
        return sorted(list_inbox(self.inbox).claims)


def _worker(run: Run, name):
    """A worker joined to the run (run.json read and pinned), its engine faked."""
    w = Worker(WorkerConfig(id=name, poll_seconds=0.01), run.store)
    view = open_run(run.store)
    w.wire(view.spec, view.trust, view.inbox, loader=None)
    w.weights.engine = SimpleNamespace(version=None)
    return w


def _make(w, run: Run) -> bool:
    """One turn of a worker: look at latest.json, run its version, claim, upload."""
    latest = w.watch.poll()
    w.weights.engine.version = latest.version
    if not w.claim():
        return False
    run.inbox.put(keys.rollout_key(latest.version, w.id, w.seq), b"batch")
    w.seq += 1
    return True


def _take(run: Run, consumed, step, lag=2) -> int:
    """The trainer's step at `step`: G groups, newest version first."""
    listing = list_inbox(run.inbox)
    fresh = {
        u: [k for k in sorted(listing.rollouts.get(u, {})) if k not in consumed]
        for u in range(max(0, step - lag), step + 1)
    }
    got = 0
    lowest = max(0, step - lag)
    for key in take_order(fresh, lowest if lowest < step else None):
        if got >= G:
            break
        consumed.add(key)
        got += B
    return got


def _planner(run: Run, versions=20, lag=2, lease=60.0):
    return Planner(run.inbox, "r1", G, B, lag, versions, surplus=2, lease=lease)


def test_two_workers_make_about_what_the_trainer_takes(tmp_path, signed_run):
    run = Run(tmp_path, signed_run)
    planner, consumed = _planner(run), set()
    workers = [_worker(run, "w1"), _worker(run, "w2")]
    run.latest(0, planner.plan(0, 0, consumed, set()))
    short = 0
    for v in range(20):
        # Workers far faster than the trainer: each makes all it can claim.
        while any([_make(w, run) for w in workers]):
            pass
        short += _take(run, consumed, v) < G
        run.latest(v + 1, planner.plan(v + 1, v + 1, set(consumed), set()))
    uploaded = len(run.rollouts())
    assert short == 0  # the trainer never went without
    assert len(consumed) == 20 * G // B
    # Never trained on: what the last demands asked beyond the run's end (none)
    # and the surplus, which rides along from version to version.
    waste = 1 - len(consumed) / uploaded
    assert waste <= 0.05, (uploaded, len(consumed))
    # Both workers made batches, and no slot was made twice.
    assert {keys.parse_rollout_key(k)[1] for k in run.rollouts()} == {"w1", "w2"}
    assert len(run.claims()) == uploaded


def test_on_policy_runs_ask_for_a_step_of_the_newest_version_only(tmp_path, signed_run):
    planner = _planner(Run(tmp_path, signed_run), lag=0)
    d = planner.plan(3, 3, set(), set())
    assert (d.version, d.slots, d.oldest) == (3, (G + 2) // B, 3)


def test_a_dead_workers_claim_lapses_and_its_slot_is_made_again(tmp_path, signed_run):
    run = Run(tmp_path, signed_run)
    planner = _planner(run, versions=1, lease=0.3)  # one step: G groups, + 2
    d0 = planner.plan(0, 0, set(), set())
    assert d0.slots == (G + 2) // B
    run.latest(0, d0)
    dead, live = _worker(run, "dead"), _worker(run, "live")
    assert _make(dead, run)
    run.inbox.delete(keys.rollout_key(0, "dead", 0))  # it died before uploading
    while _make(live, run):
        pass
    assert len(run.rollouts()) == d0.slots - 1
    consumed: set[str] = set()
    taken = _take(run, consumed, 0)
    assert taken == G  # the surplus covered the dead claim
    # While the step waits for more (say the live batches were refused), the
    # dead claim counts as on its way until its lease runs out...
    refused = {"live"}
    d = planner.plan(0, 0, set(), refused, current=d0, current_step_only=True)
    assert d.slots == d0.slots + (G - B) // B  # all but the dead claim's batch
    time.sleep(0.4)
    d = planner.plan(0, 0, set(), refused, current=d0, current_step_only=True)
    assert d.slots == d0.slots + G // B  # ...then its groups are asked for again
    run.latest(0, d)
    assert _make(live, run)  # and a live worker takes a new slot
    assert keys.parse_claim_key(run.claims()[-1])[1] >= d0.slots


def test_the_planner_measures_each_workers_claim_to_batch_time(tmp_path, signed_run):
    run = Run(tmp_path, signed_run)
    planner = _planner(run, versions=3, lease=0.3)
    d0 = planner.plan(0, 0, set(), set())
    run.latest(0, d0)
    slow = _worker(run, "slow")
    latest = slow.watch.poll()
    slow.weights.engine.version = latest.version
    assert slow.claim()
    time.sleep(0.5)  # longer than the base lease: a slow batch
    run.inbox.put(keys.rollout_key(0, "slow", slow.seq), b"batch")
    slow.seq += 1
    planner.plan(0, 0, set(), set(), current=d0)
    measured = list(planner.speeds["slow"].values())
    assert len(measured) == 1 and measured[0] >= 0.4
    assert planner.lease_of("slow") == LEASE_FACTOR * measured[0] > 0.3
    assert planner.lease_of("never-seen") == 0.3
    # Its next claim outlives the base lease.
    run.latest(0, planner.plan(0, 0, set(), set(), current=d0))
    assert _make(slow, run) and slow.claim()
    time.sleep(0.4)
    listing = list_inbox(run.inbox)
    flying = planner._claims(listing, range(0, 1), planner.opened, None)
    landed = Counter({(0, "slow"): 2})
    assert any(c.worker == "slow" for c in pending(flying, landed, time.time(), planner.lease_of))


def test_a_resumed_trainer_works_out_the_same_demand(tmp_path, signed_run):
    run = Run(tmp_path, signed_run)
    planner, consumed = _planner(run), set()
    workers = [_worker(run, "w1"), _worker(run, "w2")]
    run.latest(0, planner.plan(0, 0, consumed, set()))
    for v in range(3):
        for w in workers:
            _make(w, run)  # a batch each: the rest of the slots stay open
        _take(run, consumed, v)
        run.latest(v + 1, planner.plan(v + 1, v + 1, set(consumed), set()))
    _make(workers[0], run)
    before = planner.plan(3, 3, consumed, set(), current=None)
    announced = run.announced()
    # A new process: no cache of claims; the ledgers give it `consumed`.
    again = _planner(run).plan(3, 3, set(consumed), set(), current=announced)
    assert again == before
    # With the announced demand it keeps the slots it opened (they only grow).
    assert again.slots >= announced.slots
