"""The trainer's word as a worker reads it, acting only on what verifies.

`Watch` reads `weights/latest.json` (the newest version, the demand for
slots, the run's end; the one request a waiting worker makes),
`trainer/done.json` where latest.json does not verify, and
`trainer/quarantine.json` when latest.json says its decisions changed. A
document the trainer's key did not sign is counted in the worker's `Tally`
and otherwise ignored; the version named never goes backwards.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from colonnade.protocol import keys, read_latest
from colonnade.protocol.documents import Done, Quarantine, read_signed
from colonnade.protocol.schemas import Demand, Latest, SchemaError
from colonnade.protocol.signing import Trust
from colonnade.store import ObjectStore

from .tally import Tally

UNVERIFIED_RETRIES = 8  # quick looks again at a latest.json that does not verify


class Quarantined(RuntimeError):
    """The trainer refuses this worker's batches (trainer/quarantine.json)."""


class Watch:
    def __init__(
        self,
        store: ObjectStore,
        trust: Trust,
        worker: str,
        tally: Tally,
        stopping: Callable[[], bool],
    ) -> None:
        self.store, self.trust, self.worker = store, trust, worker
        self.tally, self.stopping = tally, stopping
        self.latest: Latest | None = None  # the last latest.json read: version, demand, done
        self.finished = False  # trainer/done.json seen (where latest.json did not verify)
        self.refused: set[str] = set()  # quarantined workers, read at each new version
        self._quarantined_seen = 0

    @property
    def demand(self) -> Demand | None:
        return self.latest.demand if self.latest is not None else None

    @property
    def newest(self) -> int | None:
        """The newest version latest.json named (None before the first look)."""
        return self.latest.version if self.latest is not None else None

    def poll(self) -> Latest | None:
        """weights/latest.json: the one request a waiting worker makes. One
        that does not verify, or names an older version than one seen, is
        ignored (None)."""
        for attempt in range(UNVERIFIED_RETRIES + 1):
            try:
                latest = read_latest(self.store, self.trust)
                break
            except SchemaError as e:
                # Someone replaced it; the trainer puts its own back within
                # about a second: a few quick looks usually find it.
                if attempt == UNVERIFIED_RETRIES or self.stopping():
                    self.tally.unverified("latest.json", e)  # once a look
                    self._check_done()
                    return None
                time.sleep(random.uniform(0.1, 0.4))
        if latest is None:
            self._check_done()
            return None
        if self.latest is not None and latest.version < self.latest.version:
            return None  # an old pointer put back: versions never go backwards
        self.latest = latest
        return latest

    def done(self) -> bool:
        """The run is over: latest.json says so (polled with each fetch), or,
        where latest.json does not verify, the trainer's done.json."""
        return self.finished or (self.latest is not None and self.latest.done)

    def _check_done(self) -> None:
        """latest.json is missing or not the trainer's: trainer/done.json then
        says whether the run is over (once the trainer has exited, nobody puts
        its latest.json back)."""
        try:
            self.finished = read_signed(self.store, keys.DONE, Done, self.trust) is not None
        except SchemaError as e:
            self.tally.unverified("done.json", e)

    def check_quarantine(self) -> None:
        """Read the quarantine again if latest.json counts new decisions since
        the last read; raises Quarantined if this worker is refused."""
        if self.latest is not None and self.latest.quarantined > self._quarantined_seen:
            self.refused = self.read_quarantine()
            self._quarantined_seen = self.latest.quarantined

    def read_quarantine(self) -> set[str]:
        """The workers the trainer refuses; raises Quarantined if this is one."""
        try:
            found = read_signed(self.store, keys.QUARANTINE, Quarantine, self.trust)
        except SchemaError as e:
            self.tally.unverified("quarantine.json", e)
            return self.refused
        decisions = found.decisions if found is not None else {}
        if self.worker in decisions:
            raise Quarantined(
                f"the trainer quarantined worker {self.worker} ({decisions[self.worker].reason}) "
                "and refuses its batches; check its weights and engine, then rejoin under a new id"
            )
        return set(decisions)
