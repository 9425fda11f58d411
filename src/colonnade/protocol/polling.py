"""How often to look in the store for something the other side is about to write.

Both sides wait on each other through the store: a paced worker for the next
version, the trainer for rollouts. A fixed poll is either too slow for a
smoke run (a version every ~0.3 s, where a 1 s poll doubled the trainer's
wait) or too many requests for a GPU trainer whose step takes a minute (each
poll is a billed LIST or GET on R2 or S3). So both poll at a tenth of the time
between versions, which they measure as they go.
"""

from __future__ import annotations

FLOOR = 0.02  # never more than 50 polls a second
FIRST = 0.05  # before any interval has been seen


def poll_interval(version_gap: float | None, poll_seconds: float) -> float:
    """A tenth of the time between versions, within [FLOOR, poll_seconds]."""
    if version_gap is None:
        return min(FIRST, poll_seconds)
    return min(max(version_gap / 10, FLOOR), poll_seconds)


def moving_gap(gap: float | None, seconds: float) -> float:
    """The moving average of the time between versions after one more."""
    return seconds if gap is None else 0.8 * gap + 0.2 * seconds
