"""Randomness nobody chooses: which tasks a claim runs, and every sampled token's draw.

A worker that could pick its random numbers could pick its tokens, and still
report the exact behaviour log-prob of each under the published weights, so
that neither the DPPO gate nor the quarantine would see it. Here everything
random in a rollout follows from names the worker does not choose:

- a claim (version, slot) decides its tasks (`slot_tasks`): a worker cannot
  pick the tasks it likes, only make the batch or leave the slot unfilled;
- a row's draws follow from (run, version, worker, slot, task, row)
  (`draw_key`) and a token's from its position in the episode (`uniforms`);
- the token is the inverse CDF of the sampling distribution over the
  vocabulary in token-id order (`engine.sampling`), so engines that differ by
  rounding pick the same token except where the draw falls within that
  rounding of a boundary.

Beside each sampled token's log-prob a worker reports the probability mass
below it in token-id order (`below`, 4 bytes a token); the trainer checks on
every sampled token, for free, that the draw falls in the token's interval
[below, below + μ] (`outside_interval`). A token that was not drawn from its
own reported distribution fails that check unless the report is forged too,
which a recomputation of the distribution (a spot check) exposes.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence

import blake3
import numpy as np

# The trainer's slack on the interval check: the worker stores `below` and the
# log-prob as float32 and normalizes in float64; both round far below this.
INTERVAL_SLACK = 2e-6
_DOMAIN = b"colonnade draws 1\0"


def draw_key(run_id: str, version: int, worker: str, slot: int, task_id: str, row: int) -> bytes:
    """The 32-byte key of one row's draws."""
    material = json.dumps([run_id, version, worker, slot, task_id, row]).encode()
    return blake3.blake3(_DOMAIN + material).digest()


def uniforms(key: bytes, positions: Sequence[int] | np.ndarray) -> np.ndarray:
    """float64 draws in [0, 1), one per position of the row keyed `key`
    (53 random bits each: every float64 in [0, 1) on the 2^-53 grid)."""
    out = np.empty(len(positions), dtype=np.float64)
    for i, p in enumerate(positions):
        word = int.from_bytes(blake3.blake3(key + int(p).to_bytes(8, "little")).digest(8), "little")
        out[i] = (word >> 11) * 2.0**-53
    return out


def slot_tasks(run_id: str, version: int, slot: int, tasks: int, k: int) -> list[int]:
    """Indices of the `k` distinct tasks (of `tasks`) that claim (version, slot) runs."""
    seed = blake3.blake3(_DOMAIN + json.dumps(["tasks", run_id, version, slot]).encode())
    rng = random.Random(seed.digest())
    return rng.sample(range(tasks), min(k, tasks))


def outside_interval(
    draws: np.ndarray, below: np.ndarray, logprobs: np.ndarray, slack: float = INTERVAL_SLACK
) -> np.ndarray:
    """Which sampled tokens' draws fall outside [below, below + exp(logprob)]
    (bool per token): a token whose draw is outside was not drawn by the rule."""
    p = np.exp(logprobs.astype(np.float64))
    lo = below.astype(np.float64)
    return (draws < lo - slack) | (draws >= lo + p + slack)


def below_for(draws: np.ndarray, logprobs: np.ndarray, at: float = 0.5) -> np.ndarray:
    """A `below` that puts each draw `at` of the way into its token's interval:
    what a simulated worker, which makes up its tokens, reports to look honest."""
    return np.maximum(draws - at * np.exp(logprobs.astype(np.float64)), 0.0)


def batch_tasks(run_id: str, version: int, slot: int, train_tasks: Sequence[str], k: int):
    """The task ids claim (version, slot) runs, in the order its groups come."""
    return [train_tasks[i] for i in slot_tasks(run_id, version, slot, len(train_tasks), k)]


def forged_draws(
    batch, run_id: str, train_tasks: Sequence[str], per_batch: int, sampled: bool
) -> str | None:
    """Why `batch` (a decoded `RolloutBatch`) was not made by the run's
    randomness, or None: its groups are the tasks its slot decides, and (with
    `sampled`: a temperature above 0) every model token's draw falls in the
    interval the batch reports for it. A honest worker never fails this."""
    want = batch_tasks(run_id, batch.version, batch.slot, train_tasks, per_batch)
    got = [g.task_id for g in batch.groups]
    if got != want:
        return f"tasks {got[:3]}... are not the ones slot {batch.slot} of v{batch.version} decides"
    if not sampled:
        return None
    bad = total = 0
    for g in batch.groups:
        for row, ep in enumerate(g.episodes):
            model = np.asarray(ep.from_model, dtype=bool)
            if not model.any():
                continue
            key = draw_key(run_id, batch.version, batch.worker, batch.slot, g.task_id, row)
            positions = np.flatnonzero(model)
            u = uniforms(key, positions)
            lp = np.asarray(ep.logprobs, dtype=np.float64)[positions]
            below = np.asarray(ep.below, dtype=np.float64)[positions]
            bad += int(outside_interval(u, below, lp).sum())
            total += positions.size
    if bad:
        return f"{bad} of {total} sampled tokens fall outside the intervals of their draws"
    return None
