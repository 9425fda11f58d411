"""A worker that takes `--delay` seconds longer per batch (sleeps before each upload).

python slow_worker.py --store DIR --id NAME --delay SECONDS [--trust TRAINER_PUB]

From the trainer's side this is a slow machine: each batch is made with the
version the worker synced to, and lands `delay` seconds later.
"""

import argparse
import logging
import sys
import time

from colonnade.config import WorkerConfig
from colonnade.rollout.worker import Worker


class SlowWorker(Worker):
    delay = 0.0

    def upload(self, batch):
        time.sleep(self.delay)
        return super().upload(batch)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--delay", type=float, required=True)
    p.add_argument("--trust", default="", help="the trainer's key file or fingerprint")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    w = SlowWorker(WorkerConfig(store=a.store, id=a.id, trust=a.trust))
    w.delay = a.delay
    sys.exit(w.run())
