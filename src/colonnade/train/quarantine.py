"""Quarantine: stop taking batches from a worker whose log-probs do not fit.

Rewards are recomputed, so a worker cannot lie about them; what it can
forge is the behaviour log-probs μ. Forged μ shows up as mismatch against
the trainer's π: a mismatch KL (|mean of log μ − log π| per token) or a
gate rate far above the rest of the fleet, whose workers run the same int8
weights. A worker whose cumulative figure exceeds both a floor and `factor`
× the others' is quarantined: its batches are refused from then on, and the
decision is logged and written to the store.

Mismatch grows with staleness (π has moved on from the version that made a
batch), so workers are compared like for like: each worker's rows against
the median of the other workers' rows made with the same version and
trained in the same step. A worker whose batches happened to be older than
the rest is not an outlier; rows no other worker matched are not judged.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field

from colonnade.protocol.documents import QuarantineDecision
from colonnade.protocol.metrics import gate_figures

log = logging.getLogger("colonnade.trainer")


@dataclass(frozen=True)
class QuarantineConfig:
    factor: float = 5.0  # × the other workers' median; 0 turns quarantine off
    kl_floor: float = 0.05  # nats per token: below this no worker is an outlier
    masked_floor: float = 0.10  # share of gated tokens: likewise
    min_tokens: int = 400  # judge a worker only on this much evidence


# What `like_for_like` sums per worker: tokens, then per-token figures × tokens.
REFERENCED = ("tokens", "kl", "ref_kl", "masked", "ref_masked")


def like_for_like(step: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """One step's {worker: {version: gate stats}} as {worker: its stats on the rows
    whose version other workers also sent, with the others' median per-token
    figures on those rows (× its tokens) as `ref_kl` and `ref_masked`}."""
    out: dict[str, dict] = {}
    for v in sorted({v for per_v in step.values() for v in per_v}):
        at = {w: per_v[v] for w, per_v in step.items() if per_v.get(v, {}).get("tokens")}
        for w, s in at.items():
            others = [gate_figures(o) for u, o in at.items() if u != w]
            if not others:
                continue
            t = out.setdefault(w, dict.fromkeys(REFERENCED, 0.0))
            kl, masked = gate_figures(s)
            t["tokens"] += s["tokens"]
            t["kl"] += kl * s["tokens"]
            t["masked"] += masked * s["tokens"]
            t["ref_kl"] += statistics.median(o[0] for o in others) * s["tokens"]
            t["ref_masked"] += statistics.median(o[1] for o in others) * s["tokens"]
    return out


def outliers(totals: dict[str, dict], cfg: QuarantineConfig) -> dict[str, str]:
    """{worker: reason} for the workers that stand far outside the others
    (`totals`: summed `like_for_like` figures)."""
    if cfg.factor <= 0:
        return {}
    out = {}
    for w, t in totals.items():
        n = t["tokens"]
        if n < cfg.min_tokens:
            continue
        kl, ref_kl, masked, ref_masked = (t[k] / n for k in REFERENCED[1:])
        if kl > max(cfg.kl_floor, cfg.factor * ref_kl):
            out[w] = f"mismatch KL {kl:.3f}/token against the others' {ref_kl:.3f} on like batches"
        elif masked > max(cfg.masked_floor, cfg.factor * ref_masked):
            out[w] = f"gate masked {masked:.2%} against the others' {ref_masked:.2%}"
    return out


@dataclass
class Ledger:
    """The trainer's running figures per worker and its decisions so far."""

    cfg: QuarantineConfig
    # worker -> why and when (trainer/quarantine.json)
    decisions: dict[str, QuarantineDecision] = field(default_factory=dict)
    totals: dict[str, dict] = field(default_factory=dict)  # summed like_for_like figures

    def judge(self, version: int, step_by_version: dict[str, dict[str, dict]]) -> bool:
        """Add a step's {worker: {version: gate stats}}; quarantine the workers
        that now stand out. True if any."""
        for w, t in like_for_like(step_by_version).items():
            mine = self.totals.setdefault(w, dict.fromkeys(REFERENCED, 0.0))
            for k in REFERENCED:
                mine[k] += t[k]
        fresh = {
            w: why for w, why in outliers(self.totals, self.cfg).items() if w not in self.decisions
        }
        for w, why in fresh.items():
            log.warning("quarantined worker %s at v%d: %s", w, version, why)
            self.decisions[w] = QuarantineDecision(why, version, time.time())
        return bool(fresh)
