"""Running the per-tensor work of a patch on threads, within a memory budget.

numpy, zstd, hashlib and the compiled kernels release the GIL on large
buffers, so threads pay. But a tensor's working memory grows with its size,
and running the two largest tensors of a model at once (a 32k-vocabulary
embedding and its output head are over half of a small model) would hold
both working sets at the same time. `budgeted_map` starts an item only while
the items in flight stay within a cost budget, taking the costliest items
that fit first; an item over the budget runs alone. `ordered` spreads the
chunks of one large tensor over the cores that are idle.
"""

from __future__ import annotations

import functools
import itertools
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def workers() -> int:
    return min(8, os.cpu_count() or 1)


# Threads of this module doing work now (budgeted_map's items and the pool's
# chunks), budgeted_map items not yet started, and budgeted_map threads
# waiting for the budget to let one start. `ordered` hands a chunk to the pool
# only where fewer threads than workers() work and no item could start
# instead (none waits, or those that wait are held back by the budget): while
# other tensors can start, every core gets one of its own, and a chunk handed
# over only made more threads than cores (the SmolLM2 patch of
# docs/benchmarks.md encoded and applied faster with its chunks inline).
_busy = 0
_waiting = 0
_held = 0
_busy_lock = threading.Lock()


def _enter() -> None:
    global _busy
    with _busy_lock:
        _busy += 1


def _leave() -> None:
    global _busy
    with _busy_lock:
        _busy -= 1


def _wait_more(n: int) -> None:
    global _waiting
    with _busy_lock:
        _waiting += n


def _hold(n: int) -> None:
    global _held
    with _busy_lock:
        _held += n


def _idle_core() -> bool:
    return _busy < workers() and (_waiting == 0 or _held > 0)


def _counted(fn: Callable[[], R]) -> R:
    _enter()
    try:
        return fn()
    finally:
        _leave()


def tensor_budget(sizes: Sequence[int]) -> int:
    """Bytes of tensors in flight at once: the largest, plus an eighth of the state.

    Enough for small tensors to run beside a large one, never two of the
    largest together in a small model; a large model (hundreds of tensors)
    still keeps every thread busy.
    """
    return max(sizes, default=0) + sum(sizes) // 8


def budgeted_map(
    fn: Callable[[T], R],
    items: Sequence[T],
    costs: Sequence[int],
    budget: int,
    n_workers: int | None = None,
) -> list[R]:
    """[fn(item) for item in items] on threads, with at most `budget` of cost in flight.

    Results come back in the order of `items`; the first exception raised by
    fn is re-raised once the running items have finished (no new ones start).
    """
    order = sorted(range(len(items)), key=lambda i: -costs[i])
    results: list[R | None] = [None] * len(items)
    errors: list[BaseException] = []
    cond = threading.Condition()
    in_flight = 0

    def take() -> int | None:
        nonlocal in_flight
        with cond:
            while order and not errors:
                for j, i in enumerate(order):
                    if in_flight == 0 or in_flight + costs[i] <= budget:
                        del order[j]
                        in_flight += costs[i]
                        _wait_more(-1)
                        return i
                _hold(1)  # nothing fits the budget: this thread is idle
                try:
                    cond.wait()
                finally:
                    _hold(-1)
            return None

    def work() -> None:
        nonlocal in_flight
        while (i := take()) is not None:
            try:
                results[i] = _counted(functools.partial(fn, items[i]))
            except BaseException as e:
                with cond:
                    errors.append(e)
            finally:
                with cond:
                    in_flight -= costs[i]
                    cond.notify_all()

    threads = [threading.Thread(target=work) for _ in range(n_workers or workers())]
    _wait_more(len(order))
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        with cond:  # items never started (after an error): none may start now
            _wait_more(-len(order))
            order.clear()
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool() -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(workers(), thread_name_prefix="pulse-chunk")
        return _POOL


def submit(fn: Callable[..., R], *args) -> Future[R]:
    """fn(*args) on the shared pool (it must not wait on other pool work)."""
    return _pool().submit(fn, *args)


def done(fn: Callable[..., R], *args) -> Future[R]:
    """fn(*args) on this thread, as a finished Future (where `submit` is not worth it)."""
    f: Future[R] = Future()
    f.set_result(fn(*args))
    return f


def ordered(thunks: Iterable[Callable[[], R]], ahead: int | None = None) -> Iterator[R]:
    """thunk() for each thunk, in order, up to `ahead` of them running at once.

    The chunks of one large tensor on the idle cores: the iterable is
    advanced (and whatever it does in order, such as reading a bit stream,
    done) on the caller's thread; a thunk (compiled kernels, which free the
    GIL) goes to a shared pool where a core is idle (`_idle_core`), and
    otherwise runs on the caller's thread. Thunks never wait on one
    another, so the pool cannot deadlock however many tensors use it at
    once; `ahead` bounds the results held. A single thunk runs on the
    caller's thread.
    """
    ahead = ahead or workers()
    it = iter(thunks)
    first = next(it, None)
    if first is None:
        return
    second = next(it, None)
    if second is None:
        yield first()
        return
    pending: deque[Future[R]] = deque()
    pool = _pool()
    try:
        for thunk in itertools.chain((first, second), it):
            if _idle_core():
                pending.append(pool.submit(_counted, thunk))
            else:
                pending.append(done(thunk))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BaseException:
        # A failure (or the caller giving up): nothing may still run once this
        # returns, since a thunk may write into memory the caller then restores.
        for f in pending:
            f.cancel()
        wait(pending)
        raise
