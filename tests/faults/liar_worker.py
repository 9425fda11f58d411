"""A worker that forges its behaviour log-probs: for fault tests.

It claims every sampled token was e times less likely than it was, which
inflates the ratio π/μ the loss weighs it by. The forgery is a fixed shift,
so its mismatch KL (1 nat/token) does not depend on how confident the
policy is (claiming near-certainty did: against a warm-started policy whose
tokens average -0.09 nats it stood barely above the floor). It forges the
commitment too (each token's `below`, so that its draw still falls in the
shrunken interval): the trainer's free check of the draws passes, and the
mismatch statistics are what find it.

python liar_worker.py --store DIR --id NAME [--trust TRAINER_PUB]
"""

import argparse
import logging
import sys

import numpy as np

from colonnade.config import WorkerConfig
from colonnade.protocol.draws import below_for, draw_key, uniforms
from colonnade.rollout.worker import Worker


class LiarWorker(Worker):
    def make_batch(self):
        batch = super().make_batch()
        run = self.joined.spec.run_id
        for g in batch.groups:
            for row, e in enumerate(g.episodes):
                at = np.flatnonzero(e.from_model)
                lps, below = np.array(e.logprobs), np.array(e.below)
                lps[at] -= 1.0
                key = draw_key(run, batch.version, self.id, batch.slot, g.task_id, row)
                below[at] = below_for(uniforms(key, at), lps[at])
                e.logprobs, e.below = lps.tolist(), below.tolist()
        return batch


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--store", required=True)
    p.add_argument("--id", required=True)
    p.add_argument("--trust", default="", help="the trainer's key file or fingerprint")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    sys.exit(LiarWorker(WorkerConfig(store=a.store, id=a.id, trust=a.trust)).run())
