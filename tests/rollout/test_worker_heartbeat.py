"""A worker's heartbeat runs on its own clock: however long a batch takes
or the worker waits for a slot, the trainer and `colonnade status` see it
alive; a store error skips one beat, not the rest."""

import threading
import time

from colonnade.rollout import worker as worker_module
from colonnade.rollout.worker import Worker
from colonnade.store import StoreUnavailable


class Busy:
    """What `_beating` reads of a worker: its running version, its heartbeat."""

    def __init__(self, version, fail_first=0):
        self.running_version = version
        self.beats, self.fail_first = 0, fail_first

    def heartbeat(self):
        if self.fail_first:
            self.fail_first -= 1
            raise StoreUnavailable("down for a moment")
        self.beats += 1


def _beat_for(busy, seconds, monkeypatch):
    monkeypatch.setattr(worker_module, "HEARTBEAT_SECONDS", 0.02)
    done = threading.Event()
    t = threading.Thread(target=Worker._beating, args=(busy, done))
    t.start()
    time.sleep(seconds)  # a batch in progress: the loop itself writes nothing
    done.set()
    t.join(timeout=5)
    assert not t.is_alive()


def test_a_worker_beats_while_a_batch_runs_and_after_a_store_error(monkeypatch):
    busy = Busy(version=3, fail_first=2)
    _beat_for(busy, 0.3, monkeypatch)
    assert busy.beats >= 5 and busy.fail_first == 0


def test_no_beat_before_a_version_runs(monkeypatch):
    idle = Busy(version=None)
    _beat_for(idle, 0.15, monkeypatch)
    assert idle.beats == 0
