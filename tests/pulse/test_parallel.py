import threading
import time

import pytest

from colonnade.pulse import parallel
from colonnade.pulse.parallel import budgeted_map, tensor_budget


class Tracker:
    """fn for budgeted_map that records the cost in flight whenever an item runs."""

    def __init__(self, costs):
        self.costs, self.lock = costs, threading.Lock()
        self.in_flight, self.seen, self.alone = 0, [], []

    def __call__(self, i):
        with self.lock:
            self.in_flight += self.costs[i]
            self.seen.append(self.in_flight)
            self.alone.append((i, self.in_flight == self.costs[i]))
        time.sleep(0.002)
        with self.lock:
            self.in_flight -= self.costs[i]
        return i * 10


def test_results_in_order_and_budget_respected():
    costs = [5, 1, 8, 3, 3, 2, 7, 1, 1, 4] * 3
    track = Tracker(costs)
    out = budgeted_map(track, list(range(len(costs))), costs, budget=9, n_workers=4)
    assert out == [i * 10 for i in range(len(costs))]
    assert max(track.seen) <= 9
    assert len(track.seen) == len(costs)


def test_item_over_budget_runs_alone():
    costs = [1, 1, 50, 1, 1, 1]
    track = Tracker(costs)
    budgeted_map(track, list(range(len(costs))), costs, budget=4, n_workers=3)
    assert dict(track.alone)[2] is True


def test_small_items_run_beside_a_large_one():
    # The budget lets one large item and small ones overlap (threads stay
    # busy): the large item waits for a small one to start while it runs.
    small_started = threading.Event()

    def fn(i):
        if i == 0:
            return small_started.wait(timeout=10)
        small_started.set()
        return True

    costs = [10, 1, 1, 1]
    assert budgeted_map(fn, [0, 1, 2, 3], costs, budget=12, n_workers=2)[0] is True


def test_first_error_is_raised_and_no_new_items_start():
    started = []

    def fn(i):
        started.append(i)
        if i == 0:
            raise ValueError("boom")
        return i

    costs = [100] + [1] * 20  # the costliest runs first, alone, and fails
    with pytest.raises(ValueError, match="boom"):
        budgeted_map(fn, list(range(21)), costs, budget=50, n_workers=2)
    assert started == [0]
    assert parallel._waiting == 0 and parallel._busy == 0  # the items never started


def test_empty_input_and_budget_rule():
    assert budgeted_map(lambda x: x, [], [], budget=1) == []
    assert tensor_budget([32, 8, 8, 16]) == 32 + 64 // 8
    assert tensor_budget([]) == 0


def _thread_of(_i=None):
    return threading.current_thread()


def test_ordered_keeps_order_and_uses_idle_cores(monkeypatch):
    monkeypatch.setattr(parallel, "workers", lambda: 2)
    me = threading.current_thread()
    got = list(parallel.ordered([lambda i=i: (i, _thread_of()) for i in range(6)], ahead=2))
    assert [i for i, _ in got] == list(range(6))
    assert any(t is not me for _, t in got)  # nothing else works: chunks go to the pool


def test_ordered_runs_inline_while_other_items_wait(monkeypatch):
    # One worker thread, three items: while the first one's chunks run, two
    # items wait for a core, so its chunks stay on its own thread.
    monkeypatch.setattr(parallel, "workers", lambda: 2)

    def item(i):
        me = threading.current_thread()
        threads = list(parallel.ordered([_thread_of] * 4))
        return i, all(t is me for t in threads)

    out = budgeted_map(item, [0, 1, 2], [3, 2, 1], budget=10, n_workers=1)
    assert out[0] == (0, True)
    assert parallel._waiting == 0 and parallel._busy == 0


def test_ordered_uses_cores_left_idle_by_the_budget(monkeypatch):
    # The largest item runs alone (the other does not fit the budget beside
    # it): the threads waiting for the budget leave their cores to its chunks.
    monkeypatch.setattr(parallel, "workers", lambda: 4)

    def item(i):
        me = threading.current_thread()
        if i == 1:
            return i, True
        time.sleep(0.05)  # the other map threads find nothing that fits
        threads = list(parallel.ordered([_thread_of] * 4))
        return i, any(t is not me for t in threads)

    out = budgeted_map(item, [0, 1], [10, 9], budget=12, n_workers=4)
    assert out[0] == (0, True)
    assert parallel._waiting == 0 and parallel._busy == 0 and parallel._held == 0
