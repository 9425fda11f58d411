"""Waiting out an unavailable store: one backoff schedule and message for every role.

The S3 client already retries each call for a few seconds; these helpers
cover longer outages (a server restart, a dropped home connection). The
worker backs off in its own loop (`backoff`); the trainer's lead waits on
each of its store operations through `Retrying`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TypeVar

from .errors import StoreUnavailable

T = TypeVar("T")


def backoff(log: logging.Logger, what: str, attempt: int, error: Exception, sleep=time.sleep):
    """Log the outage and sleep 0.5 s · 2^attempt (at most 30 s)."""
    delay = min(30.0, 0.5 * 2**attempt)
    log.warning(
        "store unavailable (%s, attempt %d): %s; retrying in %.1f s",
        what,
        attempt + 1,
        error,
        delay,
    )
    sleep(delay)


def retry_unavailable(
    log: logging.Logger, what: str, fn: Callable[[], T], deadline_s: float, sleep=time.sleep
) -> T:
    """fn() until it stops raising StoreUnavailable, backing off; gives up after deadline_s."""
    t0, attempt = time.monotonic(), 0
    while True:
        try:
            return fn()
        except StoreUnavailable as e:
            waited = time.monotonic() - t0
            if waited > deadline_s:
                raise StoreUnavailable(f"{what}: store unavailable for {waited:.0f} s: {e}") from e
            backoff(log, what, attempt, e, sleep)
            attempt += 1


class Retrying:
    """Store operations under labels, each waiting out an unavailable store.

    Built once with the operations a caller waits on through an outage,
    `Retrying(log, deadline_s, guard=check, publish=publisher.publish)`, it
    turns each into a plain call: `retrying.guard()` is `check()` called
    again while it raises StoreUnavailable (`retry_unavailable`), and raises
    once the store has been unavailable for more than `deadline_s`. The
    label (the keyword) names the operation in the log and in that error.
    Only the operations given can be called: which calls wait, and for how
    long, is written in one place.
    """

    def __init__(
        self,
        log: logging.Logger,
        deadline_s: float,
        *,
        sleep: Callable[[float], None] = time.sleep,
        **operations: Callable,
    ):
        self._log, self._deadline_s, self._sleep = log, deadline_s, sleep
        self._operations = operations

    def __getattr__(self, label: str) -> Callable:
        fn = self.__dict__.get("_operations", {}).get(label)
        if fn is None:
            raise AttributeError(f"no store operation {label!r} to retry")

        def call(*args, **kwargs):
            return retry_unavailable(
                self._log, label, lambda: fn(*args, **kwargs), self._deadline_s, self._sleep
            )

        return call
