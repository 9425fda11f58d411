"""A worker that forges its behaviour log-probs: for fault tests.

It claims every sampled token was e times less likely than it was, which
inflates the ratio π/μ the loss weighs it by. The forgery is a fixed shift,
so its mismatch KL (1 nat/token) does not depend on how confident the
policy is (claiming near-certainty did: against a warm-started policy whose
tokens average -0.09 nats it stood barely above the floor).

python liar_worker.py --store DIR --id NAME [--trust TRAINER_PUB]
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
                e.logprobs = [
                    lp - 1.0 if m else lp for lp, m in zip(e.logprobs, e.from_model, strict=True)
                ]
        return batch


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--trust", default="", help="the trainer's key file or fingerprint")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(LiarWorker(WorkerConfig(store=a.store, id=a.id, trust=a.trust)).run())
