"""Quarantine: stop taking batches from a worker whose log-probs do not fit.

Rewards are recomputed, so a worker cannot lie about them; what it can
forge is the behaviour log-probs μ. Forged μ shows up as mismatch against
the trainer's π: a mismatch KL (|mean of log μ − log π| per token) or a
gate rate far above the rest of the fleet, whose workers run the same int8
weights. A worker whose cumulative figure exceeds both a floor and `factor`
× the median of the other workers is quarantined: its batches are refused
from then on, and the decision is logged and written to the store.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

log = logging.getLogger("colonnade.trainer")


@dataclass(frozen=True)
class QuarantineConfig:
    factor: float = 5.0  # × the other workers' median; 0 turns quarantine off
    kl_floor: float = 0.05  # nats per token: below this no worker is an outlier
    masked_floor: float = 0.10  # share of gated tokens: likewise
    min_tokens: int = 400  # judge a worker only on this much evidence


def figures(stats: dict[str, float]) -> tuple[float, float]:
    """(|mismatch KL| per token, masked fraction) of summed per-worker gate stats."""
    n = max(1, stats["tokens"])
    return abs(stats["kl_sum"]) / n, 1.0 - stats["kept"] / n


def outliers(per_worker: dict[str, dict], cfg: QuarantineConfig) -> dict[str, str]:
    """{worker: reason} for the workers that stand far outside the others."""
    if cfg.factor <= 0:
        return {}
    figs = {w: figures(s) for w, s in per_worker.items() if s["tokens"] >= cfg.min_tokens}
    out = {}
    for w, (kl, masked) in figs.items():
        others = [f for v, f in figs.items() if v != w]
        if not others:
            continue
        kl_med = statistics.median(o[0] for o in others)
        masked_med = statistics.median(o[1] for o in others)
        if kl > max(cfg.kl_floor, cfg.factor * kl_med):
            out[w] = f"mismatch KL {kl:.3f}/token against the others' median {kl_med:.3f}"
        elif masked > max(cfg.masked_floor, cfg.factor * masked_med):
            out[w] = f"gate masked {masked:.2%} against the others' median {masked_med:.2%}"
    return out


def accumulate(total: dict[str, dict], step: dict[str, dict]) -> None:
    """Add one step's {worker: tokens, kept, kl_sum} into the running totals."""
    for w, s in step.items():
        t = total.setdefault(w, {"tokens": 0, "kept": 0, "kl_sum": 0.0})
        for k in t:
            t[k] += s[k]


@dataclass
class Ledger:
    """The trainer's running figures per worker and its decisions so far."""

    cfg: QuarantineConfig
    decisions: dict[str, dict] = field(default_factory=dict)  # worker -> reason, version, time
    totals: dict[str, dict] = field(default_factory=dict)  # summed gate stats, this process

    def judge(self, version: int, step_stats: dict[str, dict]) -> bool:
        """Add a step's figures; quarantine the workers that now stand out. True if any."""
        accumulate(self.totals, step_stats)
        fresh = {
            w: why for w, why in outliers(self.totals, self.cfg).items() if w not in self.decisions
        }
        for w, why in fresh.items():
            log.warning("quarantined worker %s at v%d: %s", w, version, why)
            self.decisions[w] = {"reason": why, "version": version, "time": time.time()}
        return bool(fresh)
