"""A worker with nothing to make waits at the pace of the versions.

The fleet makes what the trainer will take (train/demand.py), not more:
with no slot to claim, the worker waits until latest.json changes (a new
version, new slots, the run's end) or a stop. `Pacer` knows how far apart
the versions come (measured here once two came in a row, the trainer's own
figure before that) and looks at latest.json through the `Watch` when the
next one is about due (`protocol.polling.idle_delay`); the wait is counted
as `paced_seconds`.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from colonnade.protocol.polling import idle_delay, moving_gap

from .tally import Tally
from .watch import Watch

NAP_SECONDS = 0.5  # an idle wait sleeps in pieces this long, so a stop is seen
HINT_SECONDS = 600.0  # the most a joiner believes of latest.json's version_seconds


class Pacer:
    def __init__(
        self, watch: Watch, tally: Tally, stopping: Callable[[], bool], poll_seconds: float
    ) -> None:
        self.watch, self.tally, self.stopping = watch, tally, stopping
        self.poll_seconds = poll_seconds
        self.version_gap: float | None = None  # seconds between versions (moving average)
        self.synced_at = 0.0  # when the running version was installed (monotonic)

    def installed(self, before: int | None, now: int | None) -> None:
        """The engine moved from version `before` to `now`: one more measure
        of the gap between versions if they came in a row."""
        t = time.monotonic()
        if before is not None and now == before + 1:
            self.version_gap = moving_gap(self.version_gap, t - self.synced_at)
        self.synced_at = t

    def wait(self, running: int | None) -> None:
        """Nothing to make with version `running`: wait until latest.json
        changes or a stop, looking at it at the pace of the versions."""
        seen, t0, polls = self.watch.latest, time.monotonic(), 0
        try:
            while not self.stopping():
                delay = idle_delay(
                    self.pace(), self._since_version(running), polls, self.poll_seconds
                )
                self._nap(delay)
                if self.stopping():
                    return
                latest = self.watch.poll()
                polls += 1
                if self.watch.finished:
                    return
                if latest is not None and (
                    seen is None
                    or latest.done
                    or latest.version != seen.version
                    or latest.demand != seen.demand
                ):
                    return
        finally:
            self.tally.seconds["paced_seconds"] += time.monotonic() - t0

    def pace(self) -> float | None:
        """Seconds between versions: measured here once two versions came in
        a row, before that the trainer's own figure from latest.json (at most
        HINT_SECONDS: a worker that has measured nothing does not sleep long
        on another's word)."""
        if self.version_gap is not None:
            return self.version_gap
        latest = self.watch.latest
        hint = latest.version_seconds if latest is not None else None
        return None if hint is None else min(hint, HINT_SECONDS)

    def _since_version(self, running: int | None) -> float:
        """Seconds since the running version came: since this worker installed
        it, or, while it paces by the trainer's figure (it has just joined),
        since the trainer published it, if longer (clocks a few seconds apart
        only shorten the wait)."""
        local = time.monotonic() - self.synced_at
        p = self.watch.latest
        if self.version_gap is not None or p is None or p.version != running:
            return local
        return max(local, time.time() - p.meta.created)

    def _nap(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        while not self.stopping() and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, NAP_SECONDS))
