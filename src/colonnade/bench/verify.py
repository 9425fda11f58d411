"""Proven sampling: honest rows against forgers, through the trainer's checks.

`colonnade bench verify` runs a preset's run in one process (`--preset
smoke`, the default, or `demo`), its steps one after another (its model,
warm-started as `colonnade run --preset` starts it where the preset does;
that preset's shapes, rate and warm-up): at each version
the real engines make honest batches as a worker does (claim slots, draw
keys, the torch int8 engine, and the MLX int8 engine where installed),
forgers make theirs, and the trainer's side takes the batches due at that
version (made at v − lag, lag 0..max_lag): the free check on every token,
the spot check (`train.spot`) on rows, then a DPPO step on the honest ones,
whose weights, published as int8, are the next version.

Every honest row is recomputed (rate 1) to count false positives; every
forged row too, to know which the spot check catches when it checks it.
The spot check at the default rate runs as the collector calls it, timed
beside the train step of the same version (`overhead_fraction`).

The forgers (each makes one batch per version it can):

- `swap`: each model token, with probability 1%, replaced by the second most
  likely and reported truthfully (its log-prob and the mass below it); the
  episode ends there (what follows would have been sampled after another
  token). The free check catches it.
- `swap-forged`: the same swaps, each swapped token's interval moved over
  its draw by the least change (one endpoint moved to the draw): what a
  forger who knows the check would report.
- `hot`: samples at T = 1.3 when the run says 1.0, its reports those of
  the distribution it sampled (every draw falls inside).
- `stale`: runs v − 2 while naming v, its reports v − 2's.
- `relabel`: the batch trained last, labelled v: the same episodes under
  v's draws, every interval moved over its new draw. Its groups keep their
  tasks (as if v's slot had decided those: the free check refuses other
  tasks). The collector's replay check refuses it (a group's content digest
  leaves out its version); its spot-check figures are shown beside.

Per forger: `detection_rate` (the share of its batches rejected at the
default rate: the free check's or the replay check's, or for the spot check
the expectation from which rows fail when checked), `batches_to_detection` (measured: the
collector's own choice of rows, replayed over the forged batches in order,
many times) and its expectation from the per-batch rates beside it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch

RUN, WORKER = "bench-verify", "honest"
SWAP_SHARE = 0.01
HOT = 1.3
TRIALS = 2000  # replays of the row choice per forger
PRESETS = ("smoke", "demo")  # run presets of the model sizes the spot rate is set for


@dataclass
class Options:
    rows: int = 10_000  # honest rows in all
    versions: int = 40
    rate: float | None = None  # None: the trainer's default
    logp_tolerance: float | None = None  # None: the trainer's default
    interval_tolerance: float | None = None  # None: the trainer's default
    mlx: bool = True
    warmstart: bool = True
    seed: int = 0
    preset: str = "smoke"  # the run preset whose settings and model the bench takes
    model: str | None = None  # honest rows only, on this model (`gaps_bench`)


@dataclass
class World:
    """What every part of the bench shares: the run's settings and model."""

    cfg: object  # TrainerConfig of the preset's run
    tok: object
    env: object
    model_dir: str
    params: object  # SamplingParams of the run (stops included)
    train: list[str]  # training task ids
    by_id: dict = field(default_factory=dict)


def preset_config(opts: Options):
    """The trainer's settings of `colonnade run --preset <opts.preset>`."""
    from colonnade.config import TrainerConfig
    from colonnade.config.presets import RUN_PRESETS, TRAINER_PRESETS

    trainer = RUN_PRESETS[opts.preset]["trainer"]
    run = {k: v for k, v in trainer.items() if k != "preset"}
    cfg = TrainerConfig(**{**TRAINER_PRESETS[trainer.get("preset", opts.preset)], **run})
    for name, value in (
        ("spot_rate", opts.rate),
        ("spot_logp_tolerance", opts.logp_tolerance),
        ("spot_interval_tolerance", opts.interval_tolerance),
    ):
        if value is not None:
            setattr(cfg, name, value)
    cfg.check()
    return cfg


def preset_model(opts: Options, env) -> str:
    """The model the preset's run starts from: warm-started as `colonnade run
    --preset` does (cached) where the preset warm-starts, else as initialised."""
    from functools import partial

    from colonnade.config.presets import RUN_PRESETS
    from colonnade.envs import tokenizer_texts_of
    from colonnade.model import resolve_model
    from colonnade.train.warmstart import WarmstartConfig, warmstart

    run = RUN_PRESETS[opts.preset]
    if not opts.warmstart or "warmstart_steps" not in run:
        return resolve_model(run["model"], partial(tokenizer_texts_of, env))
    ws = WarmstartConfig(
        model=run["model"],
        env=env.name,
        good_fraction=run["good_fraction"],
        steps=run["warmstart_steps"],
    )
    return str(warmstart(ws)[0])


def world(opts: Options, model_dir: str | None = None) -> World:
    """The preset run's settings, environment and model (`model_dir`: another
    model than the run's, of a tokenizer that covers the environment)."""
    from colonnade.envs import load_environment
    from colonnade.model import load_tokenizer
    from colonnade.protocol.turns import episode_stops, run_sampling

    cfg = preset_config(opts)
    env = load_environment(cfg.env)
    model_dir = model_dir or preset_model(opts, env)
    tok = load_tokenizer(model_dir)
    params = run_sampling(cfg)
    params = replace(params, stop=episode_stops(params.stop, env))
    tasks = list(env.tasks("train"))
    return World(cfg, tok, env, model_dir, params, [t.id for t in tasks], {t.id: t for t in tasks})


# -- batches ----------------------------------------------------------------------------
def make_batch(
    w: World, engine, version: int, slots, label=None, params=None, worker: str = WORKER
):
    """One batch per slot of `version`, made as `worker` makes it (its
    slot's tasks, its draw keys) by `engine` in one run: several slots at
    once give other batch shapes. `label`: the version the keys name (a
    forger running another than it names); `params`: how it samples."""
    from colonnade.protocol import EpisodeRecord, GroupRecord, RolloutBatch
    from colonnade.protocol.draws import batch_tasks, draw_key
    from colonnade.rollout import run_episodes

    named = version if label is None else label
    g, k = w.cfg.group_size, w.cfg.groups_per_batch
    ids = {s: batch_tasks(RUN, named, s, w.train, k) for s in slots}
    tasks = [w.by_id[i] for s in slots for i in ids[s] for _ in range(g)]
    keys = [draw_key(RUN, named, worker, s, i, r) for s in slots for i in ids[s] for r in range(g)]
    results = iter(run_episodes(engine, w.env, tasks, params or w.params, keys=keys))
    out = []
    for s in slots:
        groups = []
        for i in ids[s]:
            eps = [next(results).episode for _ in range(g)]
            records = [EpisodeRecord(e.tokens, e.from_model, e.logprobs, e.finish, e.below)
                       for e in eps]  # fmt: skip
            groups.append(GroupRecord(i, records))
        out.append(RolloutBatch(worker, named, 0, groups, {}, engine.name, s))
    return out


def prompt_of(w: World, task_id: str) -> list[int]:
    """The prompt's ids, as the worker and the trainer's replay build them."""
    from colonnade.protocol.turns import task_prompt

    return task_prompt(w.tok, w.env, w.by_id[task_id])


def truth(w: World, model, batch):
    """{(group, episode): (log μ, below)} of every model token under `model`."""
    from colonnade.train.spot import Row, recompute

    at, rows = [], []
    for gi, g in enumerate(batch.groups):
        prompt = prompt_of(w, g.task_id)
        for e, ep in enumerate(g.episodes):
            at.append((gi, e))
            rows.append(Row(prompt, ep.tokens, ep.from_model))
    return dict(zip(at, recompute(model, rows, w.params, w.tok.pad_token_id or 0), strict=True))


def draws_of(batch, g: int, e: int) -> np.ndarray:
    """The public draws of episode e of group g's model tokens."""
    from colonnade.protocol.draws import draw_key, uniforms

    ep = batch.groups[g].episodes[e]
    key = draw_key(RUN, batch.version, batch.worker, batch.slot, batch.groups[g].task_id, e)
    return uniforms(key, np.flatnonzero(np.asarray(ep.from_model, dtype=bool)))


def cover(true_logp: float, true_below: float, u: float) -> tuple[float, float]:
    """(log μ, below) of the least change of the interval [below, below + μ]
    that holds the draw `u`: one endpoint moved to it."""
    lo, hi = true_below, true_below + math.exp(true_logp)
    if u < lo:
        lo = u
    elif u >= hi:
        hi = u + 1e-6
    return math.log(hi - lo), lo


def swapped(w: World, model, batch, rng: random.Random, forge: bool):
    """`batch` with each model token swapped, with probability SWAP_SHARE,
    for the second most likely under `model`, the episode ending there;
    reported truthfully, or (`forge`) with its interval moved over its draw.
    (the batch, the number of episodes swapped)"""
    from colonnade.engine.sampling import filtered_logprobs, mass_below

    out, n = copy.deepcopy(batch), 0
    for gi, g in enumerate(out.groups):
        prompt = prompt_of(w, g.task_id)
        for e, ep in enumerate(g.episodes):
            model_at = [i for i, m in enumerate(ep.from_model) if m]
            picks = [j for j, _ in enumerate(model_at) if rng.random() < SWAP_SHARE]
            if not picks:
                continue
            j, at = picks[0], model_at[picks[0]]
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + ep.tokens[:at]])).logits[0, -1:]
            logp = filtered_logprobs(logits, w.params)
            top = logp.topk(2, dim=-1).indices[0]
            token = int(top[1]) if int(top[0]) == ep.tokens[at] else int(top[0])
            lp, below = float(logp[0, token]), float(mass_below(logp, torch.tensor([token]))[0])
            if forge:
                lp, below = cover(lp, below, float(draws_of(batch, gi, e)[j]))
            ep.tokens, ep.from_model = [*ep.tokens[:at], token], ep.from_model[: at + 1]
            ep.logprobs, ep.below = [*ep.logprobs[:at], lp], [*ep.below[:at], below]
            ep.finish = "length"
            n += 1
    return out, n


def relabelled(w: World, model, batch, version: int):
    """`batch` (made at an older version) named `version`: its intervals moved
    over the new draws, from the truth under `model` (`version`'s weights)."""
    out = copy.deepcopy(batch)
    out.version = version
    true = truth(w, model, out)
    for gi, g in enumerate(out.groups):
        for e, ep in enumerate(g.episodes):
            logp, below = true[(gi, e)]
            u = draws_of(out, gi, e)
            at = np.flatnonzero(np.asarray(ep.from_model, dtype=bool))
            for k, t in enumerate(at):
                ep.logprobs[t], ep.below[t] = cover(float(logp[k]), float(below[k]), float(u[k]))
    return out


# -- the trainer's side -----------------------------------------------------------------
@dataclass
class Honest:
    """Honest rows checked, and how far the farthest stood, per engine."""

    rows: int = 0
    tokens: int = 0
    false_positives: int = 0  # rows a check refused
    gaps: dict = field(default_factory=dict)  # engine -> {"rows", "logp_max", "interval_max"}
    below_bytes: list = field(default_factory=list)  # (compressed bytes of `below`, tokens)

    def add(self, w: World, checker, batch) -> None:
        every = [(g, e) for g, grp in enumerate(batch.groups) for e in range(len(grp.episodes))]
        gaps = checker.gaps(batch, every)
        refused = rows_outside(batch)
        mine = self.gaps.setdefault(batch.engine, {"rows": 0, "logp_max": 0.0, "interval_max": 0.0})
        for (g, e), gap in zip(every, gaps, strict=True):
            self.rows += 1
            self.tokens += gap.tokens
            self.false_positives += int(gap.fails(checker.tolerance) or (g, e) in refused)
            mine["rows"] += 1
            mine["logp_max"] = max(mine["logp_max"], gap.logp)
            mine["interval_max"] = max(mine["interval_max"], gap.interval)
        self.below_bytes.append(_below_bytes(batch))


def _expected(per_batch: list[float]) -> float | None:
    """Mean batches until the first refusal when batch i is refused with
    probability per_batch[i], the batches in order and cycled: the sum over
    n of the chance that the first n all pass, over one cycle, divided by
    the chance that some batch of a cycle is refused."""
    passing, total = 1.0, 0.0
    for p in per_batch:
        total += passing
        passing *= 1 - p
    return round(total / (1 - passing), 2) if passing < 1 else None


def rows_outside(batch) -> set[tuple[int, int]]:
    """(group, episode) of the rows with a draw outside its interval (the free check)."""
    from colonnade.protocol.draws import outside_interval

    out = set()
    for g, grp in enumerate(batch.groups):
        for e, ep in enumerate(grp.episodes):
            at = np.flatnonzero(np.asarray(ep.from_model, dtype=bool))
            lp = np.asarray(ep.logprobs, dtype=np.float64)[at]
            below = np.asarray(ep.below, dtype=np.float64)[at]
            if outside_interval(draws_of(batch, g, e), below, lp).any():
                out.add((g, e))
    return out


def _below_bytes(batch) -> tuple[int, int]:
    """(wire bytes the batch's `below` adds, its tokens): the batch encoded
    with and without it (all zeros compress to nothing)."""
    from colonnade.protocol.schemas import encode_batch

    bare = copy.deepcopy(batch)
    for g in bare.groups:
        for ep in g.episodes:
            ep.below = [0.0] * len(ep.tokens)
    tokens = sum(len(ep.tokens) for g in batch.groups for ep in g.episodes)
    return len(encode_batch(batch)) - len(encode_batch(bare)), tokens


@dataclass
class Forged:
    """One forged batch: whether the free check refuses it, and which of its
    forged rows the spot check refuses when it checks them."""

    batch: object
    free: bool
    caught: dict  # (group, episode) -> refused when checked
    gaps: list  # the forged rows' RowGaps
    replayed: bool = False  # every group's content already trained (the collector's replay check)


@dataclass
class Forger:
    name: str
    caught_by: str  # "free check", "spot check" or "replay check"
    batches: list[Forged] = field(default_factory=list)

    def add(self, checker, batch, rows=None, trained: set | None = None) -> None:
        """A forged batch; `rows`: its forged rows (default: every row the
        model wrote in); `trained`: content digests of the groups trained so far."""
        from colonnade.protocol.schemas import content_digest

        if rows is None:
            rows = [(g, e) for g, grp in enumerate(batch.groups)
                    for e, ep in enumerate(grp.episodes) if any(ep.from_model)]  # fmt: skip
        if not rows:
            return
        gaps = checker.gaps(batch, rows)
        caught = {r: gap is not None and gap.fails(checker.tolerance)
                  for r, gap in zip(rows, gaps, strict=True)}  # fmt: skip
        found = [gap for gap in gaps if gap is not None]
        replayed = trained is not None and all(content_digest(g) in trained for g in batch.groups)
        self.batches.append(Forged(batch, bool(rows_outside(batch)), caught, found, replayed))

    def refused(self, chooser, f: Forged) -> bool:
        """Whether the trainer refuses `f` once: the free check, or a spot
        check of the rows `chooser` (the collector's `SpotChecker`) picks."""
        if self.caught_by == "free check":
            return f.free
        if self.caught_by == "replay check":
            return f.replayed
        return any(f.caught.get(r, False) for r in chooser.choose(f.batch))

    def summary(self, chooser) -> dict:
        rate = chooser.rate
        rows = [c for f in self.batches for c in f.caught.values()]
        if self.caught_by == "free check":
            per_batch = [float(f.free) for f in self.batches]
        elif self.caught_by == "replay check":
            per_batch = [float(f.replayed) for f in self.batches]
        else:
            per_batch = [1 - math.prod(1 - rate * c for c in f.caught.values())
                         for f in self.batches]  # fmt: skip
        mean = float(np.mean(per_batch)) if per_batch else 0.0
        return {
            "name": self.name,
            "caught_by": self.caught_by,
            "batches": len(self.batches),
            "forged_rows": len(rows),
            "caught_when_checked": round(float(np.mean(rows)), 4) if rows else None,
            # The forged rows' median gaps, against the tolerance.
            "median_gap": {
                "logp": round(float(np.median([g.logp for f in self.batches for g in f.gaps])), 5),
                "interval": round(
                    float(np.median([g.interval for f in self.batches for g in f.gaps])), 5
                ),
            }
            if rows
            else None,
            "free_check_rate": round(float(np.mean([f.free for f in self.batches])), 4)
            if self.batches
            else None,
            "detection_rate": round(mean, 4),
            "batches_to_detection": self._replay(chooser),
            "expected_batches_to_detection": _expected(per_batch),
        }

    def _replay(self, chooser) -> float | None:
        """Mean batches until the first refusal, over TRIALS replays of the
        forged batches in order (cycled); None if some replay never ends."""
        n_batches = len(self.batches)
        if not n_batches:
            return None
        counts = []
        for _ in range(TRIALS):
            for n in range(1, 20 * n_batches + 1):
                if self.refused(chooser, self.batches[(n - 1) % n_batches]):
                    counts.append(n)
                    break
            else:
                return None
        return round(float(np.mean(counts)), 2)


# -- the run ----------------------------------------------------------------------------
@dataclass
class Learner:
    """The trainer's weights and step, as `colonnade trainer` holds them."""

    policy: object
    opt: object
    aliases: dict
    step_cfg: object
    pad: int
    max_len: int

    @classmethod
    def build(cls, w: World) -> Learner:
        from colonnade.envs import success_of
        from colonnade.model import load_model, tied_aliases
        from colonnade.train.distributed import Dist
        from colonnade.train.loss import GateConfig
        from colonnade.train.policy import build_policy
        from colonnade.train.step import StepConfig

        c = w.cfg
        lm, _ = load_model(w.model_dir, dtype=torch.float32)
        aliases, max_len = tied_aliases(lm), lm.config.max_position_embeddings
        policy = build_policy(lm, Dist(), False, False, c.logit_chunk_tokens)
        opt = torch.optim.AdamW(policy.parameters(), lr=c.lr, weight_decay=c.weight_decay)
        step_cfg = StepConfig(
            temperature=c.temperature,
            micro_tokens=c.micro_tokens,
            max_grad_norm=c.max_grad_norm,
            gate=GateConfig(c.delta_low, c.delta_high, c.ratio_clip),
            success=success_of(w.env),
        )
        return cls(policy, opt, aliases, step_cfg, w.tok.pad_token_id, max_len)

    def publish(self) -> dict:
        """The int8 state a trainer publishes of the current weights."""
        from colonnade import pulse
        from colonnade.train.distributed import Dist
        from colonnade.train.policy import full_state

        return pulse.prepare(full_state(self.policy, Dist(), self.aliases), "int8")

    def step(self, w: World, batches, version: int) -> float:
        """The DPPO step that makes version + 1 from the batches' groups
        (replayed as the trainer replays them), at the trainer's rate for it
        (warm-up included); its seconds."""
        from colonnade.train.samples import rebuild_group
        from colonnade.train.step import train_step, warmup_lr

        for group in self.opt.param_groups:
            group["lr"] = warmup_lr(w.cfg.lr, version, w.cfg.warmup_versions)

        groups = []
        for b in batches:
            for g in b.groups:
                samples = rebuild_group(w.tok, w.env, g, b.version, w.params.stop,
                                        self.max_len, set(w.train))  # fmt: skip
                for s in samples:
                    s.worker = b.worker
                groups.append(samples)
        t0 = time.perf_counter()
        train_step(self.policy, self.opt, groups, self.pad, self.step_cfg)
        return time.perf_counter() - t0


def engine_at(w: World, state, version: int, kind: str = "torch"):
    """An engine of `kind` running `state` as a worker runs it."""
    from colonnade.engine import engine_for
    from colonnade.model import load_model

    model, _ = load_model(w.model_dir, dtype=torch.float32)
    return engine_for(model, w.tok, state, "int8", torch.device("cpu"), kind, version)


def spot_checker(w: World, rate: float):
    """The trainer's `SpotChecker` for this run, at `rate`."""
    from colonnade.model import skeleton
    from colonnade.train.spot import SpotChecker, Tolerance

    c = w.cfg
    return SpotChecker(
        lambda: skeleton(w.model_dir),  # as the trainer builds its checks' engines
        w.tok,
        w.env,
        w.params,
        "int8",
        rate,
        Tolerance(c.spot_logp_tolerance, c.spot_interval_tolerance),
        keep=c.max_lag + 1,
    )


FORGERS = (
    ("swap", "free check"),
    ("swap-forged", "spot check"),
    ("hot", "spot check"),
    ("stale", "spot check"),
    ("relabel", "replay check"),
)


@dataclass
class Bench:
    """The run's state between versions."""

    w: World
    opts: Options
    learner: Learner
    engines: dict  # "torch", "mlx" (where installed), "stale": the worker's engines
    full: object  # SpotChecker at rate 1: every row, to count
    collector: object  # SpotChecker at the default rate, as the collector calls it
    honest: Honest = field(default_factory=Honest)
    forgers: dict = field(default_factory=lambda: {n: Forger(n, by) for n, by in FORGERS})
    due: dict = field(default_factory=dict)  # version -> [(batch, trained on)]
    states: dict = field(default_factory=dict)
    made: int = 0  # honest batches made
    # (spot check seconds, train step seconds) of each step after the first
    # (which builds the checker's model and warms the step up)
    timings: list = field(default_factory=list)
    previous: object = None  # the batch trained last, for the relabeller
    trained: set = field(default_factory=set)  # content digests of the groups trained on

    def queue(self, batch, version: int, trained: bool) -> None:
        """An honest batch, taken at a lag of 0..max_lag (in turn)."""
        lag = self.made % (self.w.cfg.max_lag + 1)
        self.made += 1
        self.due.setdefault(min(version + lag, self.opts.versions - 1), []).append((batch, trained))

    def workers(self, v: int) -> None:
        """The honest batches of version v: the step's, one slot a run as a
        worker makes them, then more, two slots a run (another batch shape),
        in turn on torch and MLX, until the rows reach their share."""
        c, opts = self.w.cfg, self.opts
        per_step = c.groups_per_step // c.groups_per_batch
        per_batch = c.groups_per_batch * c.group_size
        for s in range(per_step):
            self.queue(make_batch(self.w, self.engines["torch"], v, [s])[0], v, True)
        target = math.ceil(opts.rows * (v + 1) / opts.versions / per_batch)
        slot, turn = per_step, 0
        while self.made < target:
            kind = "mlx" if "mlx" in self.engines and turn % 2 else "torch"
            for b in make_batch(self.w, self.engines[kind], v, [slot, slot + 1]):
                self.queue(b, v, False)
            slot, turn = slot + 2, turn + 1

    def forge(self, v: int, slot: int = 1000) -> None:
        """Each forger's batch of version v."""
        w, f, truth_model = self.w, self.forgers, self.engines["torch"].backend.model
        base = make_batch(w, self.engines["torch"], v, [slot])[0]
        rng = random.Random(f"{self.opts.seed} {v}")
        for name, forge in (("swap", False), ("swap-forged", True)):
            batch, _ = swapped(w, truth_model, base, rng, forge)
            rows = [(g, e) for g, grp in enumerate(batch.groups)
                    for e, ep in enumerate(grp.episodes)
                    if ep.tokens != base.groups[g].episodes[e].tokens]  # fmt: skip
            if rows:
                f[name].add(self.full, batch, rows)
        hot = replace(w.params, temperature=HOT)
        f["hot"].add(self.full, make_batch(w, self.engines["torch"], v, [slot + 1], params=hot)[0])
        if v >= 2:
            stale = make_batch(w, self.engines["stale"], v - 2, [slot + 2], label=v)[0]
            f["stale"].add(self.full, stale)
        if self.previous is not None:
            again = relabelled(w, truth_model, self.previous, v)
            f["relabel"].add(self.full, again, trained=self.trained)

    def trainer(self, v: int) -> None:
        """The batches due at v: checked (every row, and at the default rate
        as the collector does, timed), then the step on the step's batches."""
        step, spot = [], 0.0
        for batch, trained in self.due.pop(v, []):
            self.honest.add(self.w, self.full, batch)
            if trained:
                t0 = time.perf_counter()
                self.collector(batch)
                spot += time.perf_counter() - t0
                step.append(batch)
        if step:
            from colonnade.protocol.schemas import content_digest

            self.trained.update(content_digest(g) for b in step for g in b.groups)
            self.previous = step[-1]
            train = self.learner.step(self.w, step, v)
            if v > 0:
                self.timings.append((spot, train))

    def advance(self, v: int) -> None:
        """Version v + 1 published; the workers' engines follow it (the stale one lags 2)."""
        from colonnade.engine import refresh

        self.states[v + 1] = self.learner.publish()
        for name, engine in self.engines.items():
            u = v + 1 if name != "stale" else max(0, v - 1)
            if engine.version != u:
                refresh(engine, self.states[u], None, u)


def run_bench(opts: Options) -> dict:
    from colonnade.engine.mlx_backend import mlx_missing

    t0 = time.perf_counter()
    w = world(opts)
    learner = Learner.build(w)
    states = {0: learner.publish()}
    engines = {"torch": engine_at(w, states[0], 0), "stale": engine_at(w, states[0], 0)}
    if opts.mlx and mlx_missing() is None:
        engines["mlx"] = engine_at(w, states[0], 0, "mlx")
    rate = w.cfg.spot_rate
    b = Bench(w, opts, learner, engines, spot_checker(w, 1.0), spot_checker(w, rate))
    b.states = states
    for v in range(opts.versions):
        _log(f"v{v}: {b.honest.rows} honest rows checked so far")
        for checker in (b.full, b.collector):
            checker.add(v, b.states[v])
        b.workers(v)
        b.forge(v)
        b.trainer(v)
        b.advance(v)
    return report(b, time.perf_counter() - t0)


def gaps_bench(opts: Options) -> dict:
    """Honest rows only, on `opts.model` as published at v0 (no training):
    how far each engine's rows stand from the trainer's recomputation, at
    the batch shapes a worker runs (one slot a run, then two). The gaps of
    a model deeper than the tiny one are what the tolerances must clear."""
    from colonnade.engine.mlx_backend import mlx_missing
    from colonnade.model import load_model, resolve_model, tied_aliases
    from colonnade.pulse import prepare
    from colonnade.train.distributed import Dist
    from colonnade.train.policy import full_state

    t0 = time.perf_counter()
    w = world(replace(opts, warmstart=False), resolve_model(opts.model))
    model, _ = load_model(w.model_dir, dtype=torch.float32)
    state = prepare(full_state(model, Dist(), tied_aliases(model)), "int8")
    engines = {"torch": engine_at(w, state, 0)}
    if opts.mlx and mlx_missing() is None:
        engines["mlx"] = engine_at(w, state, 0, "mlx")
    checker = spot_checker(w, 1.0)
    checker.add(0, state)
    honest = Honest()
    per_batch = w.cfg.groups_per_batch * w.cfg.group_size
    slot, turn = 0, 0
    while honest.rows < opts.rows:
        kind = list(engines)[turn % len(engines)]
        slots = [slot] if turn % 4 < 2 else [slot, slot + 1]
        for b in make_batch(w, engines[kind], 0, slots):
            honest.add(w, checker, b)
        slot, turn = slot + len(slots), turn + 1
        _log(f"{honest.rows} of {opts.rows} honest rows ({per_batch} a batch)")
    return {
        "machine": "see docs/benchmarks.md",
        "model": opts.model,
        "tolerance": {"logp": w.cfg.spot_logp_tolerance, "interval": w.cfg.spot_interval_tolerance},
        "honest_rows": honest.rows,
        "honest_tokens": honest.tokens,
        "false_positives": honest.false_positives,
        "honest_gaps": {k: _rounded(g) for k, g in sorted(honest.gaps.items())},
        "check_rows_per_second": round(checker.rows_checked / max(checker.seconds, 1e-9), 1),
        "seconds": round(time.perf_counter() - t0, 1),
    }


def report(b: Bench, seconds: float) -> dict:
    from colonnade.config.presets import RUN_PRESETS

    c, h = b.w.cfg, b.honest
    added, tokens = (sum(x) for x in zip(*h.below_bytes, strict=True))
    spot, train = (sum(x) for x in zip(*b.timings, strict=True)) if b.timings else (0.0, 0.0)
    return {
        "machine": "see docs/benchmarks.md",
        "preset": b.opts.preset,
        "model": RUN_PRESETS[b.opts.preset]["model"]
        + (
            ", warm-started"
            if b.opts.warmstart and "warmstart_steps" in RUN_PRESETS[b.opts.preset]
            else ""
        ),
        "versions": b.opts.versions,
        "max_lag": c.max_lag,
        "rows_per_batch": c.groups_per_batch * c.group_size,
        "spot_rate": c.spot_rate,
        "tolerance": {"logp": c.spot_logp_tolerance, "interval": c.spot_interval_tolerance},
        "honest_rows": h.rows,
        "honest_tokens": h.tokens,
        "false_positives": h.false_positives,
        "honest_gaps": {k: _rounded(g) for k, g in sorted(h.gaps.items())},
        "bytes_per_token": round(added / max(1, tokens), 3),
        "overhead_fraction": round(spot / max(train, 1e-9), 4),
        "spot_seconds_per_step": round(spot / max(1, len(b.timings)), 4),
        "train_seconds_per_step": round(train / max(1, len(b.timings)), 4),
        "check_rows_per_second": round(b.full.rows_checked / max(b.full.seconds, 1e-9), 1),
        # of the collector's spot-check time, the share spent loading versions
        "spot_load_fraction": round(b.collector.load_seconds / max(b.collector.seconds, 1e-9), 3),
        "forgers": [f.summary(b.collector) for f in b.forgers.values()],
        "seconds": round(seconds, 1),
    }


def _rounded(d: dict) -> dict:
    return {k: round(x, 6) if isinstance(x, float) else x for k, x in d.items()}


def _log(msg: str) -> None:
    print(f"[bench verify] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rows", type=int, default=10_000, help="honest rows in all (default 10000)")
    p.add_argument("--versions", type=int, default=40, help="versions trained (default 40)")
    p.add_argument("--rate", type=float, default=None, help="spot rate (default: the trainer's)")
    p.add_argument("--logp-tolerance", type=float, default=None, help="(default: the trainer's)")
    p.add_argument(
        "--interval-tolerance", type=float, default=None, help="(default: the trainer's)"
    )
    p.add_argument(
        "--preset",
        choices=PRESETS,
        default="smoke",
        help="the run preset whose settings, environment and model the bench takes (default smoke)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="honest rows only, on this model (a preset such as smollm2-135m, or a folder) "
        "as published, untrained: each engine's gaps, which the tolerances must clear",
    )
    p.add_argument("--no-mlx", action="store_true", help="honest rows from torch only")
    p.add_argument(
        "--no-warmstart", action="store_true", help="the tiny model as initialised (quicker)"
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON on stdout")


def run(args: argparse.Namespace) -> int:
    if args.rows < 1 or args.versions < 3:
        raise SystemExit("error: --rows must be >= 1 and --versions >= 3")
    opts = Options(
        args.rows,
        args.versions,
        args.rate,
        args.logp_tolerance,
        args.interval_tolerance,
        not args.no_mlx,
        not args.no_warmstart,
        preset=args.preset,
        model=args.model,
    )
    if opts.model is not None:
        out = gaps_bench(opts)
        print(json.dumps(out, indent=2))
        return 0
    out = run_bench(opts)
    print(json.dumps(out, indent=2) if args.json else markdown(out))
    return 0


def markdown(out: dict) -> str:
    head = (
        f"honest rows {out['honest_rows']}, false positives {out['false_positives']}, "
        f"{out['bytes_per_token']} bytes a token, overhead {out['overhead_fraction']:.1%} "
        f"at spot rate {out['spot_rate']}\n\n"
        "| forger | caught by | caught when checked | detection rate | batches to detection "
        "(measured) | (expected) |\n|---|---|---|---|---|---|"
    )
    body = [
        f"| {f['name']} | {f['caught_by']} | {f['caught_when_checked']} | "
        f"{f['detection_rate']} | {f['batches_to_detection']} | "
        f"{f['expected_batches_to_detection']} |"
        for f in out["forgers"]
    ]
    return "\n".join([head, *body])
