"""What a worker's next metric row reports: counts and seconds since the last.

Every part of the worker counts into one `Tally` (the worker builds it
first); `row` turns it into a `WorkerRow` for an uploaded batch and starts
the next. A document the trainer did not sign is counted here too, and
logged once per kind (`unverified`).
"""

from __future__ import annotations

import logging
import time

from colonnade.protocol import RolloutBatch
from colonnade.protocol.metrics import WorkerRow

log = logging.getLogger("colonnade.worker")

COUNTS = ("sync_bytes", "store_errors", "store_retries", "unverified", "tool_failures",
          "overflows")  # fmt: skip
# sync = apply (download, patch, hash) + load (the changed tensors into the engine)
SECONDS = ("sync_seconds", "apply_seconds", "load_seconds", "paced_seconds")


class Tally:
    def __init__(self) -> None:
        self.counts = dict.fromkeys(COUNTS, 0)
        self.seconds = dict.fromkeys(SECONDS, 0.0)
        self._said: set[str] = set()  # kinds of unsigned document logged already

    def unverified(self, kind: str, error: Exception) -> None:
        """A document that the trainer did not sign: counted, logged once per kind."""
        self.counts["unverified"] += 1
        if kind not in self._said:
            self._said.add(kind)
            log.warning("ignored %s: not signed by the trainer's key (%s)", kind, error)

    def synced(self, apply_seconds: float, load_seconds: float) -> None:
        """A version installed: fetched beside generation, then loaded."""
        self.seconds["apply_seconds"] += apply_seconds
        self.seconds["load_seconds"] += load_seconds
        self.seconds["sync_seconds"] += apply_seconds + load_seconds

    def row(self, batch: RolloutBatch, seconds: float, newest: int | None) -> WorkerRow:
        """The row of `batch` (made and uploaded in `seconds`; `newest`: the
        newest version seen when it landed); the tally starts again."""
        eps = [e for g in batch.groups for e in g.episodes]
        row = WorkerRow(
            time=time.time(),
            version=batch.version,
            version_skew=(newest or batch.version) - batch.version,
            episodes=len(eps),
            tokens=sum(sum(e.from_model) for e in eps),
            seconds=round(seconds, 3),
            reward_mean=batch.stats.get("reward_claimed", 0.0),
            **self.counts,
            **{k: round(v, 3) for k, v in self.seconds.items()},
        )
        self.counts = dict.fromkeys(self.counts, 0)
        self.seconds = dict.fromkeys(self.seconds, 0.0)
        return row
