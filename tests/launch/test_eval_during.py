"""Held-out evals while training: which versions are evaluated, one at a time."""

import threading

from colonnade.launch.evaluation import EvalDuring


class _Recording(EvalDuring):
    def __init__(self, every):
        super().__init__(None, None, 5, None, 5, every)
        self.evaluated, self.release = [], threading.Event()

    def _run(self, version):
        self.evaluated.append(version)
        self.release.wait(5)


def test_every_mark_once_and_never_two_at_a_time():
    d = _Recording(every=10)
    for v in (1, 5, 9):
        d.poll(v)
    assert d.evaluated == []
    d.poll(10)
    d.thread.join(0.1)
    d.poll(11)  # no mark
    d.poll(23)  # a mark passed while v10's eval still runs: taken later
    assert d.evaluated == [10]
    d.release.set()
    d.close()
    d.poll(24)  # the next version after it ends
    d.close()
    d.poll(29)
    d.poll(30)
    d.close()
    assert d.evaluated == [10, 24, 30]


def test_off_when_every_is_zero():
    d = _Recording(every=0)
    for v in range(1, 50):
        d.poll(v)
    assert d.evaluated == [] and d.thread is None
