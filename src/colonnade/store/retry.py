"""Waiting out an unavailable store: one backoff schedule and message for every role.

The S3 client already retries each call for a few seconds; these helpers
cover longer outages (a server restart, a dropped home connection).
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
