"""The trainer's demand: how much the fleet should still make, as claim slots.

Who calls it: the trainer, after each step (the demand goes up with the
next version's latest.json) and while it waits for groups (so an expired
claim or a refused batch opens new slots within a version); on resume, from
what the store holds. Workers read it in latest.json and claim slots
(`rollout/worker.py`); docs/protocol.md, "Demand and claims", has the rules.

Why: workers that generate as fast as they can make far more than the
trainer takes, which trains on the newest groups first and lets the rest
age out of the max_lag window (protocol 3 paced workers by a count of
batches in the store, two steps' worth per version, and still let them
generate anyway after a timer: about half of what was uploaded was never
trained on, docs/benchmarks.md). Here the trainer says what it will take.

How much (`wanted_groups`): what the trainer's next steps will take
(`horizon`), less what is already made and not yet taken (`ready`) and
what is promised (claims not yet fulfilled nor expired, and slots opened but
not yet claimed), plus `surplus` groups so that one straggler holding a
claim does not hold the trainer. The horizon is two steps when stale groups
are usable (max_lag >= 1): a step's worth is then ready when a step starts,
made while the step before trained, so the trainer does not wait for the
version it has just published; one step when only the newest version counts;
never past max_versions, so a run ends with nothing left over. This is
AReaL's bound (at most (offpolicyness + 1) batches of work ahead of the
trainer, counting what runs) with an offpolicyness of one step, and
prime-rl's async_level, enforced by the workers claiming rather than by an
orchestrator that hands out requests: here the workers are strangers that
pull.

While the trainer waits for groups it works the demand out again (about
once a second, `current_step_only`): an expired claim or a refused batch
then opens new slots within a version, for the shortfall of the step in
progress only; the steps after are the next version's demand.

Claims (`pending`): a worker claims one slot per batch and uploads before it
claims again, so its batches of a version fulfil its claims of that version
in order; an unfulfilled claim is given up when its worker's lease runs out
(by the object's store time), or at once when the same worker has claimed
since (it restarted, or lost the upload: that batch is never coming).

The lease follows each worker's measured speed (`claim_times`,
`lease_for`): the time from each claim to the batch that fulfilled it, by
store times, over the worker's recent claims; a worker's lease is
LEASE_FACTOR times its slowest of those, never below the run's
`claim_seconds` (a worker not yet measured has that), never above
MAX_LEASE_FACTOR times it. A Mac on a large model that needs minutes per
batch keeps its claims; the base stays the bound for a worker that died
before it was measured.

Claims are strangers' objects (protocol 7): one counts only if it reads as a
claim of this run, names a worker, and in a signed run carries that
worker's signature (a registered one); a claim of a slot the demand never
opened is not even read. Each worker holds at most one claim in flight, so
ghosts cannot freeze the demand: an unsigned, unknown or garbage claim
holds nothing, and its slot is opened again.
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from colonnade.protocol import keys
from colonnade.protocol.documents import Claim, open_claim
from colonnade.protocol.inbox import Listing, list_inbox
from colonnade.protocol.schemas import Demand, SchemaError
from colonnade.store import ObjectStore, StoreError, StoreUnavailable


def horizon(step: int, max_versions: int, per_step: int, max_lag: int) -> int:
    """Groups the steps from `step` on will take before the groups of the
    version published for `step` age out or the run ends."""
    depth = 2 if max_lag >= 1 else 1
    return per_step * max(0, min(depth, max_versions - step))


def wanted_groups(horizon_groups: int, taken: int, surplus: int, ready: int, promised: int) -> int:
    """Groups still to start: the horizon less what this step already took,
    what is made and not yet taken, and what is promised; plus the surplus."""
    if horizon_groups - taken <= 0:
        return 0  # the run is over, or the last step has its groups
    return max(0, horizon_groups - taken + surplus - ready - promised)


def new_slots(open_slots: int, wanted: int, per_batch: int) -> int:
    """The demand's slot count after asking for `wanted` more groups: slots
    only grow (a slot once opened may be claimed at any time)."""
    return open_slots + math.ceil(wanted / per_batch)


# A worker's lease: this many times its slowest recent claim-to-batch time
# (a batch may take longer than the slowest seen: a longer task, a busier
# machine), within [claim_seconds, MAX_LEASE_FACTOR * claim_seconds].
LEASE_FACTOR = 3.0
MAX_LEASE_FACTOR = 20.0
RECENT_CLAIMS = 8  # claim-to-batch times remembered per worker
MEASURED_WORKERS = 4096  # workers whose times are remembered (the least recent forgotten)


def claim_times(claims: list[SeenClaim], batches: dict[tuple[int, str], list[float]]) -> dict:
    """{(version, slot, worker): seconds from the claim to the batch that
    fulfilled it}: a worker's batches of a version (their store times,
    `batches[(version, worker)]`) fulfil its claims of that version in
    order, as `pending` counts them."""
    out = {}
    mine: dict[tuple[int, str], list[SeenClaim]] = {}
    for c in sorted(claims, key=lambda c: (c.at, c.slot)):
        if c.worker is not None:
            mine.setdefault((c.version, c.worker), []).append(c)
    for (v, worker), made in mine.items():
        for c, at in zip(made, sorted(batches.get((v, worker), [])), strict=False):
            out[(v, c.slot, worker)] = max(0.0, at - c.at)
    return out


def lease_for(recent: list[float], base: float) -> float:
    """A worker's lease from its recent claim-to-batch times (see the module
    docstring); `base` (the run's claim_seconds) when none is known."""
    if not recent:
        return base
    return min(max(base, LEASE_FACTOR * max(recent)), MAX_LEASE_FACTOR * base)


@dataclass(frozen=True)
class SeenClaim:
    """One claim as the trainer knows it: read once, then cached."""

    version: int
    slot: int
    worker: str | None  # None: the object did not read as a claim (never fulfilled)
    at: float  # the object's store time, seconds since the epoch


def pending(
    claims: list[SeenClaim], landed: Counter, now: float, lease: float | Callable[[str], float]
) -> list[SeenClaim]:
    """The claims still in flight: not fulfilled by a landed batch and not
    given up. `landed` counts batches per (version, worker); `lease`: one
    for every worker, or each worker's (`lease(worker)`)."""
    lease_of = lease if callable(lease) else (lambda worker: lease)
    by_worker: dict[str | None, list[SeenClaim]] = {}
    for c in sorted(claims, key=lambda c: (c.at, c.version, c.slot)):
        by_worker.setdefault(c.worker, []).append(c)
    out = []
    for worker, mine in by_worker.items():
        if worker is None:
            continue
        fulfilled: Counter = Counter()
        unfulfilled = []
        for c in mine:
            if fulfilled[c.version] < landed[(c.version, worker)]:
                fulfilled[c.version] += 1
            else:
                unfulfilled.append(c)
        # At most one claim per worker is in flight: its newest.
        if unfulfilled and unfulfilled[-1] is mine[-1] and now - mine[-1].at < lease_of(worker):
            out.append(mine[-1])
    return sorted(out, key=lambda c: (c.at, c.version, c.slot))


@dataclass
class Planner:
    """Works out the demand from the inbox: one listing gives the window's
    rollouts and the claims with their store times (each claim read once)."""

    store: ObjectStore  # the inbox
    run_id: str
    per_step: int
    per_batch: int
    max_lag: int
    max_versions: int
    surplus: int
    lease: float  # the run's claim_seconds: the base of every worker's lease
    seen: dict[str, SeenClaim] = field(default_factory=dict)  # claim key -> what it said
    # worker -> {(version, slot): claim-to-batch seconds}, its most recent claims
    speeds: dict[str, dict[tuple[int, int], float]] = field(default_factory=dict)
    opened: dict[int, int] = field(default_factory=dict)  # version -> slots its demand opened
    # The publication (background) and the wait for groups (main thread) both plan.
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _claims(self, listing: Listing, versions: range, opened: dict[int, int],
                keyring: dict | None) -> list[SeenClaim]:  # fmt: skip
        """The claims of `versions` in slots that were opened (`opened`: version
        -> slots; a version absent: any slot), each read once."""
        out = []
        for key, (u, slot, at) in listing.claims.items():
            if u not in versions or slot >= opened.get(u, keys.MAX_SLOT + 1):
                continue
            if key not in self.seen:
                self.seen[key] = SeenClaim(u, slot, self._worker(key, keyring), at)
            out.append(self.seen[key])
        lowest = versions.start
        self.seen = {k: c for k, c in self.seen.items() if c.version >= lowest}
        return out

    def _worker(self, key: str, keyring: dict | None) -> str | None:
        try:
            data = self.store.get(key, max_bytes=Claim.MAX_BYTES)
            return open_claim(data, key, self.run_id, keyring).worker
        except StoreUnavailable:
            raise
        except (StoreError, SchemaError):  # not a claim we accept: it holds nothing
            return None

    def lease_of(self, worker: str) -> float:
        """`worker`'s lease now: from its recent claim-to-batch times."""
        return lease_for(list(self.speeds.get(worker, {}).values()), self.lease)

    def _measure(self, claims: list[SeenClaim], batches: dict) -> None:
        """Each worker's claim-to-batch times, its RECENT_CLAIMS newest kept."""
        for (v, slot, worker), seconds in claim_times(claims, batches).items():
            mine = self.speeds[worker] = self.speeds.pop(worker, {})  # most recent last
            mine[(v, slot)] = seconds
            if len(mine) > RECENT_CLAIMS:
                for old in sorted(mine)[: len(mine) - RECENT_CLAIMS]:
                    del mine[old]
        while len(self.speeds) > MEASURED_WORKERS:
            del self.speeds[next(iter(self.speeds))]

    def plan(
        self,
        step: int,
        target: int,
        consumed: set[str],
        refused: set[str],
        taken: int = 0,
        current: Demand | None = None,
        current_step_only: bool = False,
        keyring: dict | None = None,
    ) -> Demand:
        """The demand for slots of version `target` (the newest published, or
        the one about to be), seen from the step at version `step`, which has
        taken `taken` groups so far; `current` is the demand workers see now.

        `consumed`: rollout keys taken already; `refused`: quarantined workers,
        whose batches and claims count for nothing. `current_step_only`: the
        shortfall of the step in progress, without surplus (while waiting).
        `keyring`: a signed run's registered keys (worker -> public key)."""
        if current_step_only:
            need, surplus = (self.per_step if step < self.max_versions else 0), 0
        else:
            need = horizon(step, self.max_versions, self.per_step, self.max_lag)
            surplus = self.surplus
        with self._lock:
            registered = set(keyring) if keyring is not None else None
            listing = list_inbox(self.store, registered, target)
            return self._plan(step, target, consumed, refused, taken, current, need, surplus,
                              listing, keyring)  # fmt: skip

    def _plan(self, step, target, consumed, refused, taken, current, need, surplus,
              listing, keyring) -> Demand:  # fmt: skip
        oldest = max(0, step - self.max_lag)
        versions = range(min(oldest, target), target + 1)
        landed: Counter = Counter()
        batches: dict[tuple[int, str], list[float]] = {}
        ready = 0
        for u, found in listing.rollout_keys(versions).items():
            for key in found:
                worker = listing.rollouts[u][key]
                landed[(u, worker)] += 1
                batches.setdefault((u, worker), []).append(listing.rollout_times.get(key, 0.0))
                if u >= oldest and key not in consumed and worker not in refused:
                    ready += self.per_batch
        if current is not None:
            self.opened[current.version] = max(self.opened.get(current.version, 0), current.slots)
        claims = self._claims(listing, versions, self.opened, keyring)
        self._measure(claims, batches)
        flying = [
            c
            for c in pending(claims, landed, time.time(), self.lease_of)
            if c.worker not in refused
        ]
        promised = self.per_batch * sum(c.version >= oldest for c in flying)
        mine = [c for c in claims if c.version == target]
        open_slots = max([c.slot + 1 for c in mine], default=0)
        if current is not None and current.version == target:
            open_slots = max(open_slots, current.slots)
        if target >= oldest:  # unclaimed slots: a worker may take them any time
            promised += self.per_batch * (open_slots - len({c.slot for c in mine}))
        want = wanted_groups(need, taken, surplus, ready, promised)
        if target < oldest:
            want = 0  # L = 0 and the step's version is not out yet: nothing it could use
        slots = min(new_slots(open_slots, want, self.per_batch), keys.MAX_SLOT + 1)
        self.opened[target] = max(slots, self.opened.get(target, 0))
        self.opened = {u: n for u, n in self.opened.items() if u >= versions.start}
        return Demand(target, slots, min(oldest, target), self.lease)
