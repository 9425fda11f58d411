"""How often to look in the store for something the other side is about to write.

Both sides wait on each other through the store: a worker with nothing to
make for the next version or demand, the trainer for rollouts. A fixed poll
is either too slow for a smoke run (versions a fraction of a second apart,
where a 1 s poll doubled the trainer's wait) or too many requests for a GPU trainer whose
step takes a minute (each poll is a billed LIST or GET on R2 or S3). So both
follow the time between versions, which they measure as they go: the
trainer polls at a tenth of it; an idle worker sleeps until the next version
is about due and then polls at a tenth of it (`idle_delay`), a few requests
per version however long a version takes.
"""

from __future__ import annotations

FLOOR = 0.02  # never more than 50 polls a second
FIRST = 0.05  # before any interval has been seen
DUE = 0.8  # an idle worker's first look: this share of the interval after the last version


def poll_interval(version_gap: float | None, poll_seconds: float) -> float:
    """A tenth of the time between versions, within [FLOOR, poll_seconds]."""
    if version_gap is None:
        return min(FIRST, poll_seconds)
    return min(max(version_gap / 10, FLOOR), poll_seconds)


def moving_gap(gap: float | None, seconds: float) -> float:
    """The moving average of the time between versions after one more."""
    return seconds if gap is None else 0.8 * gap + 0.2 * seconds


def idle_delay(gap: float | None, elapsed: float, polls: int, poll_seconds: float) -> float:
    """How long a worker with nothing to make waits before it looks at
    latest.json again, `elapsed` seconds after its version came and `polls`
    looks into the wait: until the next version is about due, then a tenth of
    the interval; before any interval is known, doubling from FIRST up to
    poll_seconds."""
    if gap is None:
        return min(FIRST * 2 ** min(polls, 16), poll_seconds)
    due = DUE * gap - elapsed
    return due if due > FLOOR else max(FLOOR, gap / 10)
