"""Spot checks: a share of rows recomputed on the published weights of their version.

The free check (`protocol.draws.forged_draws`) proves that every sampled
token's public draw falls in the interval [below, below + μ] the worker
reports for it. A worker that forges its reports consistently passes it:
one that samples hotter than the run says, runs an older version than it
names, or swaps tokens and moves their intervals over the draws. What it
cannot forge is the distribution itself: every engine runs the same
published codes, so the trainer can recompute it.

A `SpotChecker` holds the prepared states of the versions a step may take
(v − max_lag … v; the lead adds each one it publishes) and a CPU torch model
of the run's architecture per version it has checked rows of (a model whose
version left the window takes the next one in place). For a
batch, each row is chosen with probability `rate` by the trainer's own
randomness (`secrets`: nothing a worker sees tells it which rows), and a
chosen row is teacher-forced over prompt + tokens, the run's sampling
distribution taken of each position (`engine.sampling.filtered_logprobs`:
temperature, top-k, top-p), and each model token's reported log μ and
interval compared with the recomputed ones (`RowGap`). Tool-reply tokens
are not sampled: the replay checks them (train/samples.py).

Engines running the same codes still differ by rounding (the torch int8
kernel rounds activations to bf16, MLX keeps float32; batch shapes pick
different kernels), so a row fails only past a tolerance measured between
engines (docs/benchmarks.md, "Proven sampling"). A row that fails is a
proof: the collector rejects its batch as forged and the lead quarantines
the worker (train/collect.py, train/lead.py).

How soon a forger is caught follows from the rate: a batch of n forged rows
escapes with probability (1 − rate)^n.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from colonnade.protocol.schemas import RolloutBatch
from colonnade.protocol.turns import SamplingParams, task_prompt

log = logging.getLogger("colonnade.trainer")
# Row-positions whose logits exist at once while recomputing (× vocabulary
# float32 each): bounds the check's memory on a large vocabulary.
LOGIT_POSITIONS = 4096


@dataclass(frozen=True)
class Tolerance:
    """How far an honest row may stand from the recomputed distribution."""

    logp: float  # nats: a row's mean |reported − recomputed log μ| over its model tokens
    interval: float  # probability: a token's largest endpoint gap, [below, below + μ]


@dataclass(frozen=True)
class RowGap:
    """How far one row's reports stand from the recomputed distribution."""

    logp: float  # mean |Δ log μ| over the row's model tokens
    interval: float  # max over them of max(|Δ below|, |Δ (below + μ)|)
    tokens: int  # model tokens compared

    def fails(self, tol: Tolerance) -> bool:
        return self.logp > tol.logp or self.interval > tol.interval


def row_gap(
    logp: np.ndarray, below: np.ndarray, true_logp: np.ndarray, true_below: np.ndarray
) -> RowGap:
    """The gap between reported (`logp`, `below`) and recomputed values, one
    entry per model token (float64 arrays of one length)."""
    if logp.size == 0:
        return RowGap(0.0, 0.0, 0)
    upper = below + np.exp(logp)
    true_upper = true_below + np.exp(true_logp)
    ends = np.maximum(np.abs(below - true_below), np.abs(upper - true_upper))
    return RowGap(float(np.abs(logp - true_logp).mean()), float(ends.max()), int(logp.size))


@dataclass(frozen=True)
class Row:
    """One episode to recompute: the prompt, its tokens after it, which the model wrote."""

    prompt: Sequence[int]
    tokens: Sequence[int]
    from_model: Sequence[bool]


@torch.inference_mode()
def recompute(
    model, rows: Sequence[Row], params: SamplingParams, pad_id: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(log μ, below) of every model token of each row under `model`'s
    sampling distribution (`params`), float64, teacher-forced: rows padded
    on the right (causal attention never sees the pads), in chunks of at
    most `LOGIT_POSITIONS` kept logits."""
    from colonnade.engine.sampling import filtered_logprobs, mass_below

    order = sorted(range(len(rows)), key=lambda i: len(rows[i].prompt) + len(rows[i].tokens))
    done: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for chunk in _chunks(order, rows):
        width = max(len(rows[i].prompt) + len(rows[i].tokens) for i in chunk)
        # Logits of the positions from the shortest prompt's last token on.
        keep = width - min(len(rows[i].prompt) for i in chunk) + 1
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        for b, i in enumerate(chunk):
            seq = [*rows[i].prompt, *rows[i].tokens]
            ids[b, : len(seq)] = torch.tensor(seq)
        logits = model(input_ids=ids, logits_to_keep=keep).logits
        picked, tokens, sizes = [], [], []
        for b, i in enumerate(chunk):
            r = rows[i]
            at = np.flatnonzero(np.asarray(r.from_model, dtype=bool))
            # Token t after the prompt is predicted at column len(prompt) - 1 + t,
            # kept as column that - (width - keep).
            picked.append(logits[b, torch.from_numpy(at + len(r.prompt) - 1 - (width - keep))])
            tokens.extend(r.tokens[t] for t in at)
            sizes.append(at.size)
        logp = filtered_logprobs(torch.cat(picked), params)
        toks = torch.tensor(tokens, dtype=torch.long)
        mu = logp.gather(-1, toks[:, None]).squeeze(-1).double().numpy()
        below = mass_below(logp, toks).numpy()
        ends = np.cumsum([0, *sizes])
        for k, i in enumerate(chunk):
            done[i] = (mu[ends[k] : ends[k + 1]], below[ends[k] : ends[k + 1]])
    return [done[i] for i in range(len(rows))]


def one_thread(fn, *args):
    """`fn(*args)` on one intra-op thread: a check is a few short passes
    (and a version's load), which a second thread slows: its
    synchronisation costs more than it shares at this size, and far more
    when another process holds a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


def _chunks(order: list[int], rows: Sequence[Row]):
    """Runs of `order` (shortest first) whose kept logits fit `LOGIT_POSITIONS`."""
    chunk: list[int] = []
    for i in order:
        width = len(rows[i].prompt) + len(rows[i].tokens)
        shortest = min((len(rows[j].prompt) for j in [*chunk, i]), default=0)
        if chunk and (len(chunk) + 1) * (width - shortest + 1) > LOGIT_POSITIONS:
            yield chunk
            chunk = []
        chunk.append(i)
    if chunk:
        yield chunk


class SpotChecker:
    """Recomputes a sampled share of rows on their version's published state.

    The lead builds it with the run's model skeleton and settings, adds each
    prepared state it publishes (`add`, from the background publication),
    and the collector calls it on every batch that passed the free check:
    `checker(batch)` is None, or the proof that a row was forged.
    """

    def __init__(
        self,
        skeleton: Callable[[], torch.nn.Module],
        tokenizer,
        env,
        params: SamplingParams,
        precision: str,
        rate: float,
        tolerance: Tolerance,
        keep: int,
        draw: Callable[[], float] | None = None,
    ):
        self.skeleton, self.tokenizer, self.env = skeleton, tokenizer, env
        self.params, self.precision = params, precision
        self.rate, self.tolerance = rate, tolerance
        self.keep = keep  # versions held: max_lag + 1
        # Uniform in [0, 1), from the OS: which rows are checked is nobody's to know.
        self.draw = draw or (lambda: secrets.randbits(53) * 2.0**-53)
        self.states: dict[int, Mapping[str, torch.Tensor]] = {}
        self._lock = threading.Lock()  # `add` runs in the background publication
        # version -> an engine holding it: one CPU model per version held, so
        # that batches of several versions in one step load each version once
        self._engines: dict[int, object] = {}
        self._held: dict[int, dict[str, torch.Tensor]] = {}  # the state each engine was given
        self._prompts: dict[str, list[int]] = {}
        self.rows_checked = 0
        self.seconds = 0.0  # spent checking, in total
        self.load_seconds = 0.0  # of which building models and loading versions into them

    def add(self, version: int, state: Mapping[str, torch.Tensor]) -> None:
        """The prepared state of a version just published (or adopted):
        held while a step may take its batches."""
        with self._lock:
            self.states[version] = state
            for old in [v for v in self.states if v <= version - self.keep]:
                del self.states[old]

    def choose(self, batch: RolloutBatch) -> list[tuple[int, int]]:
        """(group, episode) of each row checked: each with probability `rate`."""
        return [
            (g, e)
            for g, group in enumerate(batch.groups)
            for e in range(len(group.episodes))
            if self.draw() < self.rate
        ]

    def __call__(self, batch: RolloutBatch) -> str | None:
        """Why a row of `batch` is forged, or None (also when its version's
        state is no longer held, or no row was chosen)."""
        chosen = self.choose(batch)
        if not chosen:
            return None
        gaps = self.gaps(batch, chosen)
        for (g, e), gap in zip(chosen, gaps, strict=True):
            if gap is not None and gap.fails(self.tolerance):
                return (
                    f"spot check: episode {e} of {batch.groups[g].task_id[:40]!r} is not "
                    f"v{batch.version}'s: mean |Δ log μ| {gap.logp:.3g} (tolerance "
                    f"{self.tolerance.logp:g}), interval gap {gap.interval:.3g} "
                    f"({self.tolerance.interval:g})"
                )
        return None

    def gaps(self, batch: RolloutBatch, chosen: Sequence[tuple[int, int]]) -> list[RowGap | None]:
        """The gap of each chosen row; None for rows that cannot be recomputed
        (their version no longer held, a task the run does not have, longer
        than the model: the replay refuses those)."""
        with self._lock:
            state = self.states.get(batch.version)
        if state is None:
            log.info("spot check skipped: v%d is no longer held", batch.version)
            return [None] * len(chosen)
        t0 = time.perf_counter()
        model = one_thread(self._model, batch.version, state)
        limit = model.config.max_position_embeddings
        rows: list[Row | None] = []
        for g, e in chosen:
            prompt = self._prompt(batch.groups[g].task_id)
            ep = batch.groups[g].episodes[e]
            fits = prompt is not None and len(prompt) + len(ep.tokens) <= limit
            rows.append(Row(prompt, ep.tokens, ep.from_model) if fits else None)
        pad = self.tokenizer.pad_token_id or 0
        live = [r for r in rows if r is not None]
        done = iter(one_thread(recompute, model, live, self.params, pad))
        out: list[RowGap | None] = []
        for (g, e), row in zip(chosen, rows, strict=True):
            if row is None:
                out.append(None)
                continue
            true_logp, true_below = next(done)
            ep = batch.groups[g].episodes[e]
            at = np.flatnonzero(np.asarray(ep.from_model, dtype=bool))
            logp = np.asarray(ep.logprobs, dtype=np.float64)[at]
            below = np.asarray(ep.below, dtype=np.float64)[at]
            out.append(row_gap(logp, below, true_logp, true_below))
        self.rows_checked += len(live)
        self.seconds += time.perf_counter() - t0
        return out

    def _prompt(self, task_id: str) -> list[int] | None:
        """The prompt's ids as the replay rebuilds them; None for a task the run does not have."""
        if task_id not in self._prompts:
            try:
                task = self.env.task(task_id)
            except Exception:  # an unknown id: the replay rejects its group
                return None
            self._prompts[task_id] = task_prompt(self.tokenizer, self.env, task)
        return self._prompts[task_id]

    def _model(self, version: int, state: Mapping[str, torch.Tensor]):
        """The CPU model holding `version`'s published weights: a model of a
        version no longer held takes it in place, else a new one is built."""
        from colonnade.engine import engine_for, refresh

        engine = self._engines.get(version)
        if engine is None:
            t0 = time.perf_counter()
            with self._lock:
                spare = [v for v in self._engines if v not in self.states]
            if spare:
                engine = self._engines.pop(spare[0])
                held = self._held.pop(spare[0])
                # Tensors a version shares with the one the engine holds (a
                # LoRA run's base: the publisher keeps the same objects) are
                # not loaded again.
                changed = {k for k, t in state.items() if held.get(k) is not t}
                refresh(engine, state, changed, version)
            else:
                cpu = torch.device("cpu")
                engine = engine_for(
                    self.skeleton(), self.tokenizer, state, self.precision, cpu, version=version
                )
            self._engines[version] = engine
            self._held[version] = dict(state)
            self.load_seconds += time.perf_counter() - t0
        return engine.backend.model
