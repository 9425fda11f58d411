"""Quarantine: stop taking batches from a worker whose log-probs do not fit.

Rewards are recomputed, so a worker cannot lie about them; what it can
forge is the behaviour log-probs μ. Forged μ shows up as mismatch against
the trainer's π: a mismatch KL (|mean of log μ − log π| per token) or a
gate rate far above the rest of the fleet, whose workers run the same int8
weights. A worker whose cumulative figure exceeds both a floor and `factor`
× the others' is quarantined: its batches are refused from then on, and the
decision is logged and written to the store.

Mismatch grows with staleness (π has moved on from the version that made a
batch), and how fast π moves changes over a run, so workers are compared
like for like: each worker's row (one step's tokens of one behaviour
version) against the median of the other workers' rows of the same lag
(versions between the one that made the batch and the one it was trained
at) from the nearest behaviour versions, at most `window` versions away,
pooled over the run. A worker whose batches happened to be older than the
rest is not an outlier; a lag no other worker sent near that version is
not judged. Pooling by lag alone compared a late row with early ones: in
a smoke run whose policy moved 20× faster mid-run than at its start, an
honest worker's lag-1 rows of v4 (0.063/token) were judged against the
other's lag-1 rows of v0–v2 (0.001) and quarantined. Pooling across steps
matters with small steps, where one step often holds one worker's batches
only: matching within a step judged nobody there.
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
    window: int = 2  # versions between a row's batches and the others' it is judged by


# What `like_for_like` sums per worker: tokens, then per-token figures × tokens.
REFERENCED = ("tokens", "kl", "ref_kl", "masked", "ref_masked")
POOLED = ("tokens", "kl", "masked")  # per worker, lag and version: tokens, figures × tokens

Pooled = dict[str, dict[tuple[int, int], dict]]  # {worker: {(lag, behaviour version): sums}}


def pool(pooled: Pooled, version: int, step: dict[str, dict[str, dict]]):
    """Add one step's {worker: {behaviour version: gate stats}}, which trained
    version − 1 into `version`, to `pooled`. Each row's mismatch counts by
    magnitude, so a worker cannot cancel a forgery of one sign by one of the
    other."""
    for w, per_v in step.items():
        for b, s in per_v.items():
            if not s.get("tokens"):
                continue
            kl, masked = gate_figures(s)
            t = pooled.setdefault(w, {}).setdefault(
                (version - 1 - int(b), int(b)), dict.fromkeys(POOLED, 0.0)
            )
            t["tokens"] += s["tokens"]
            t["kl"] += kl * s["tokens"]
            t["masked"] += masked * s["tokens"]


def like_for_like(pooled: Pooled, window: int = QuarantineConfig.window) -> dict[str, dict]:
    """{worker: its pooled figures on the rows other workers have peers for,
    with the peers' median per-token figures (× its tokens) as `ref_kl` and
    `ref_masked`, and `rows`: each row's per-token (kl, ref_kl, masked,
    ref_masked)}. A row's peers: the other workers' rows of its lag from
    the behaviour versions nearest its own, at most `window` away."""
    out: dict[str, dict] = {}
    for w, rows in pooled.items():
        for (lag, b), t in rows.items():
            others = _peers(pooled, w, lag, b, window)
            if not others:
                continue
            n = t["tokens"]
            tot = out.setdefault(w, {**dict.fromkeys(REFERENCED, 0.0), "rows": []})
            ref_kl = statistics.median(o["kl"] / o["tokens"] for o in others)
            ref_masked = statistics.median(o["masked"] / o["tokens"] for o in others)
            tot["tokens"] += n
            tot["kl"] += t["kl"]
            tot["masked"] += t["masked"]
            tot["ref_kl"] += ref_kl * n
            tot["ref_masked"] += ref_masked * n
            tot["rows"].append((t["kl"] / n, ref_kl, t["masked"] / n, ref_masked))
    return out


def _peers(pooled: Pooled, worker: str, lag: int, version: int, window: int) -> list[dict]:
    """The other workers' rows of `lag` whose behaviour version is nearest
    `version` (all those at that distance), none beyond `window`."""
    near = [
        (abs(b - version), t)
        for u, rows in pooled.items()
        if u != worker
        for (row_lag, b), t in rows.items()
        if row_lag == lag and abs(b - version) <= window
    ]
    if not near:
        return []
    closest = min(d for d, _ in near)
    return [t for d, t in near if d == closest]


def outliers(totals: dict[str, dict], cfg: QuarantineConfig) -> dict[str, str]:
    """{worker: reason} for the workers that stand far outside the others
    (`totals`: summed `like_for_like` figures): their pooled figure, and most
    of their rows one by one. An honest worker's rows are heavy-tailed (the
    tasks it drew may be where π moved most: a smoke worker whose weights
    were exact stood at 0.064/token against the other's 0.005, one of its
    episodes 0.51/token from the next version's log-probs);
    a forger's every row stands out."""
    if cfg.factor <= 0:
        return {}
    out = {}
    for w, t in totals.items():
        n = t["tokens"]
        if n < cfg.min_tokens:
            continue
        kl, ref_kl, masked, ref_masked = (t[k] / n for k in REFERENCED[1:])
        rows = t.get("rows", [])
        if _out(kl, ref_kl, cfg.kl_floor, cfg) and _most(rows, 0, cfg.kl_floor, cfg):
            out[w] = f"mismatch KL {kl:.3f}/token against the others' {ref_kl:.3f} on like batches"
        elif _out(masked, ref_masked, cfg.masked_floor, cfg) and _most(
            rows, 2, cfg.masked_floor, cfg
        ):
            out[w] = f"gate masked {masked:.2%} against the others' {ref_masked:.2%}"
    return out


def _out(figure: float, ref: float, floor: float, cfg: QuarantineConfig) -> bool:
    return figure > max(floor, cfg.factor * ref)


def _most(rows: list[tuple], i: int, floor: float, cfg: QuarantineConfig) -> bool:
    """Whether more than half of `rows` stand out on figure `i` (against `i + 1`)."""
    return 2 * sum(_out(r[i], r[i + 1], floor, cfg) for r in rows) > len(rows)


@dataclass
class Ledger:
    """The trainer's running figures per worker and its decisions so far."""

    cfg: QuarantineConfig
    # worker -> why and when (trainer/quarantine.json)
    decisions: dict[str, QuarantineDecision] = field(default_factory=dict)
    pooled: Pooled = field(default_factory=dict)  # see `pool`

    def judge(self, version: int, step_by_version: dict[str, dict[str, dict]]) -> bool:
        """Add the step that made `version` ({worker: {behaviour version: gate
        stats}}); quarantine the workers that now stand out. True if any."""
        pool(self.pooled, version, step_by_version)
        fresh = {
            w: why
            for w, why in outliers(like_for_like(self.pooled, self.cfg.window), self.cfg).items()
            if w not in self.decisions
        }
        for w, why in fresh.items():
            log.warning("quarantined worker %s at v%d: %s", w, version, why)
            self.decisions[w] = QuarantineDecision(why, version, time.time())
        return bool(fresh)
