"""A worker's claims on the trainer's demand: which slot of a version it makes.

The demand (in latest.json) opens `slots` batches of one version; a worker
running that version claims one before it generates, by writing
`claims/{v}/{slot}` in the inbox with put-if-absent: the first writer has
it. `Claims` is told the demand and the running version at each call and
remembers only what it found of the version's slots. docs/protocol.md,
"Demand and claims", has the rules; train/demand.py is the trainer's side.
"""

from __future__ import annotations

import random
import time

from colonnade.protocol import keys
from colonnade.protocol.documents import Claim, open_claim, seal_claim
from colonnade.protocol.schemas import Demand, SchemaError
from colonnade.store import NotFound, ObjectStore, StoreError

# Slots tried per look at the demand, after a listing of the taken ones:
# workers that look at once may still collide, and each try is a billed request.
CLAIM_TRIES = 2


class Claims:
    def __init__(self, inbox: ObjectStore, worker: str, private, run_id: str) -> None:
        self.inbox, self.worker, self.private, self.run_id = inbox, worker, private, run_id
        self.taken: tuple[int | None, set[int]] = (None, set())  # (version, slots found taken)
        self.count = 0  # slots claimed by this process
        self.held: tuple[int, int] | None = None  # (version, slot) of the last claim won
        # Claims whose put failed (an outage): it may have landed all the same,
        # so a retry that finds the slot taken reads whose it is.
        self.unsure: set[str] = set()

    def free(self, demand: Demand | None, version: int | None) -> list[int]:
        """Slots of `version` that the demand opens and this worker has not
        found taken (none when the demand is for another version)."""
        if demand is None or version is None or demand.version != version:
            return []
        if self.taken[0] != version:
            self.taken = (version, set())
        return [s for s in range(demand.slots) if s not in self.taken[1]]

    def claim(self, demand: Demand | None, version: int | None) -> bool:
        """Claim a slot of `version` (put-if-absent; the first writer has it):
        whether this worker is to make a batch now. One listing of the
        version's claims tells which slots are taken (a slot someone else
        holds, a ghost's included, is never tried blind: a worker that tried
        taken slots and waited for the demand to change would wait for ever
        where the trainer counted an untried slot as promised); then a few
        random free slots are tried, so that many workers seldom collide."""
        free = self.free(demand, version)
        if not free:
            return False
        for key in self.inbox.list(keys.claims_dir(version)):
            found = keys.parse_claim_key(key)
            if found is not None and found[0] == version and key not in self.unsure:
                self.taken[1].add(found[1])
        free = [s for s in free if s not in self.taken[1]]
        for slot in random.sample(free, min(CLAIM_TRIES, len(free))):
            key = keys.claim_key(version, slot)
            claim = seal_claim(self.private, self.run_id, key, Claim(self.worker, time.time()))
            try:
                won = self.inbox.put_if_absent(key, claim)
            except StoreError:
                # Not marked taken: the slot stays this worker's to try again
                # once the store answers (marking it would leave a worker that
                # saw an outage with no free slot and a demand that never changes).
                self.unsure.add(key)
                raise
            self.taken[1].add(slot)  # ours or another's: not free either way
            if won or (key in self.unsure and self._mine(key)):
                self.unsure.discard(key)
                self.count += 1
                self.held = (version, slot)
                return True
        return False

    def _mine(self, key: str) -> bool:
        """Whether the claim at `key` is this worker's (a put that failed but landed)."""
        try:
            found = open_claim(
                self.inbox.get(key, max_bytes=Claim.MAX_BYTES), key, self.run_id, None
            )
        except (NotFound, SchemaError):
            return False
        return found.worker == self.worker
