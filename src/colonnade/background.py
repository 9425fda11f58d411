"""Work off the critical path: one job at a time, in order, in a thread.

The trainer publishes each version this way (after the optimizer step it
hands a CPU snapshot to a job that encodes and uploads it, and goes on to
collect and train the next step); a worker fetches the next version this way
(download, patch, hash check) while its engine generates. `submit` first
waits for the job in flight, so at most one runs and they finish in order;
the time it waited is what the caller was blocked (the trainer's
`publish_blocked_seconds`). A job's error (the store down past its retries)
is raised in the caller at the next `wait`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class Background:
    def __init__(self, name: str = "publish") -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._job: Future | None = None

    @property
    def busy(self) -> bool:
        return self._job is not None and not self._job.done()

    def wait(self) -> float:
        """Until the job in flight is done (re-raising its error); seconds waited."""
        t0 = time.monotonic()
        job, self._job = self._job, None
        if job is not None:
            job.result()
        return time.monotonic() - t0

    def submit(self, job: Callable[[], object]) -> float:
        """Wait for the job in flight, then start `job`; the seconds waited."""
        blocked = self.wait()
        self._job = self._pool.submit(job)
        return blocked

    def close(self) -> None:
        """Wait for the job in flight (its error, if any, is raised), then stop."""
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)
