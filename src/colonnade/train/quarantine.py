"""Quarantine: stop taking batches from a worker whose log-probs do not fit.

Rewards are recomputed, so a worker cannot lie about them; what it can
forge is the behaviour log-probs μ. Forged μ shows up as mismatch against
the trainer's π: a mismatch KL (|mean of log μ − log π| per token) or a
gate rate far above the rest of the fleet, whose workers run the same int8
weights. A worker whose pooled figure exceeds both a floor and `factor`
× the others' is quarantined: its batches are refused from then on, and the
decision is logged and written to the store.

Mismatch grows with staleness (π has moved on from the version that made a
batch), and how fast π moves changes over a run, so workers are compared
like for like: each worker's row (one step's tokens of one behaviour
version) against the other workers' rows of the same lag (versions between
the one that made the batch and the one it was trained at) from the nearest
behaviour versions, at most `window` versions away (their token-weighted
median), pooled over the run. A worker whose batches happened to be older
than the rest is not an outlier; a lag no other worker sent near that
version is not judged. Pooling by lag alone compared a late row with early
ones: in a smoke run whose policy moved far faster mid-run than at its
start, an honest worker's late lag-1 rows were judged against the other's
early lag-1 rows, far below them, and quarantined
(docs/benchmarks.md). Pooling across steps matters with small steps, where
one step often holds one worker's batches only: matching within a step
judged nobody there.

An honest worker's figures are heavy-tailed by step. The tasks it drew may
be where π moved most in that step (a smoke worker whose weights were exact
stood far above the other in one step, on the strength of one episode the
next version had moved far on), and a step that only one worker's batches
fed has no peer sharing its π: a jump of π there shows as that worker's
mismatch alone (another smoke worker, alone in two steps, stood orders of
magnitude higher there than in its other steps). So a worker is judged
without its worst third of steps (`trim_share`, rounded down: none below 3
steps). A forger that forges in at most a third of its steps goes unseen,
which bounds what it can move (and the gate and clip still apply).
"""

from __future__ import annotations

import logging
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
    trim_share: float = 1 / 3  # of a worker's steps, its worst, set aside when judging it


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
    with the peers' figures (× its tokens) as `ref_kl` and `ref_masked`, and
    the same sums per training step under `steps` ({version trained into:
    sums})}. A row's peers: the other workers' rows of its lag from the
    behaviour versions nearest its own, at most `window` away; their
    token-weighted median is its reference (a tiny row sets nothing, and a
    forger among the peers holding under half their tokens moves nothing)."""
    index = _by_lag(pooled)
    out: dict[str, dict] = {}
    for w, rows in pooled.items():
        for (lag, b), t in rows.items():
            peers = _peers(index[lag], w, b, window)
            if not peers:
                continue
            n = t["tokens"]
            ref_kl = _weighted_median([(o["kl"] / o["tokens"], o["tokens"]) for o in peers])
            ref_masked = _weighted_median([(o["masked"] / o["tokens"], o["tokens"]) for o in peers])
            tot = out.setdefault(w, {**dict.fromkeys(REFERENCED, 0.0), "steps": {}})
            per_step = tot["steps"].setdefault(b + lag + 1, dict.fromkeys(REFERENCED, 0.0))
            for sums in (tot, per_step):
                sums["tokens"] += n
                sums["kl"] += t["kl"]
                sums["masked"] += t["masked"]
                sums["ref_kl"] += ref_kl * n
                sums["ref_masked"] += ref_masked * n
    return out


def _by_lag(pooled: Pooled) -> dict[int, dict[int, list[tuple[str, dict]]]]:
    """{lag: {behaviour version: [(worker, row)]}}: peers found by lookup, not by
    scanning every row of every worker for every row."""
    index: dict[int, dict[int, list[tuple[str, dict]]]] = {}
    for w, rows in pooled.items():
        for (lag, b), t in rows.items():
            index.setdefault(lag, {}).setdefault(b, []).append((w, t))
    return index


def _peers(by_version: dict[int, list], worker: str, version: int, window: int) -> list[dict]:
    """The other workers' rows (of one lag) whose behaviour version is nearest
    `version` (those on both sides at that distance), none beyond `window`."""
    for d in range(window + 1):
        found = [
            t for v in {version - d, version + d} for u, t in by_version.get(v, ()) if u != worker
        ]
        if found:
            return found
    return []


def _weighted_median(pairs: list[tuple[float, float]]) -> float:
    """The median of values weighted by their tokens (the mean of the two
    middle values where the weight splits exactly between them)."""
    pairs = sorted(pairs)
    half = sum(w for _, w in pairs) / 2
    seen = 0.0
    for i, (value, weight) in enumerate(pairs):
        seen += weight
        if seen > half:
            return value
        if seen == half:
            return (value + pairs[i + 1][0]) / 2
    return pairs[-1][0]


def outliers(totals: dict[str, dict], cfg: QuarantineConfig) -> dict[str, str]:
    """{worker: reason} for the workers that stand far outside the others
    (`totals`: summed `like_for_like` figures), each judged without its
    worst `cfg.trim_share` of steps (see the module's notes)."""
    if cfg.factor <= 0:
        return {}
    out = {}
    for w, t in totals.items():
        for fig, ref, floor in (
            ("kl", "ref_kl", cfg.kl_floor),
            ("masked", "ref_masked", cfg.masked_floor),
        ):
            n, figure, reference, trimmed = _judged(t, fig, ref, cfg.trim_share)
            if n < cfg.min_tokens or figure <= max(floor, cfg.factor * reference):
                continue
            aside = f", its worst {trimmed} of {len(t['steps'])} steps aside" if trimmed else ""
            if fig == "kl":
                out[w] = (
                    f"mismatch KL {figure:.3f}/token against the others' {reference:.3f} "
                    f"on like batches{aside}"
                )
            else:
                out[w] = f"gate masked {figure:.2%} against the others' {reference:.2%}{aside}"
            break
    return out


def _judged(t: dict, fig: str, ref: str, share: float) -> tuple[float, float, float, int]:
    """(tokens, per-token figure, per-token reference, steps set aside) of a
    worker's `like_for_like` sums, without the `share` of its steps (rounded
    down) that stand out most on `fig`."""
    n, f, r = t["tokens"], t[fig], t[ref]
    steps = sorted(t["steps"].values(), key=lambda s: s[fig] - s[ref], reverse=True)
    trimmed = int(len(steps) * share + 1e-9)
    for worst in steps[:trimmed]:
        n, f, r = n - worst["tokens"], f - worst[fig], r - worst[ref]
    if n <= 0:
        return 0.0, 0.0, 0.0, trimmed
    return n, f / n, r / n, trimmed


@dataclass
class Ledger:
    """The trainer's running figures per worker and its decisions so far."""

    cfg: QuarantineConfig
    # worker -> why and when (trainer/quarantine.json)
    decisions: dict[str, QuarantineDecision] = field(default_factory=dict)
    pooled: Pooled = field(default_factory=dict)  # see `pool`

    def convict(self, worker: str, proof: str, version: int) -> bool:
        """Quarantine `worker` on a proof (a batch its claim's draws did not
        make), not on figures; True if it is a new decision."""
        if worker in self.decisions:
            return False
        log.warning("quarantined worker %s at v%d: %s", worker, version, proof)
        self.decisions[worker] = QuarantineDecision(f"forged: {proof}"[:200], version, time.time())
        return True

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
