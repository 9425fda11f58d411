"""A worker that forges its behaviour log-probs (claims near-certainty): for fault tests.

python liar_worker.py --store DIR --id NAME
"""

import argparse
import logging
import sys

from colonnade.config import WorkerConfig
from colonnade.rollout.worker import Worker


class LiarWorker(Worker):
    def make_batch(self):
        batch = super().make_batch()
        for g in batch.groups:
            for e in g.episodes:
                e.logprobs = [-0.01 if m else 0.0 for m in e.from_model]
        return batch


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--id", required=True)
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(LiarWorker(WorkerConfig(store=a.store, id=a.id)).run())
