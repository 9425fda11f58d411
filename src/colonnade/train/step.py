"""One RL step: advantages per group, π's log-probs, the DPPO loss, AdamW.

On one device or across ranks, the same path:

1. rank 0 scores the groups (GRPO advantages; a group of equal rewards is
   skipped) and packs the samples into micro-batches by a token budget
   (`batching`), which it hands to every rank as tensors;
2. every rank runs its micro-batches: log π of the generated tokens
   (`Policy`), the DPPO loss summed over kept tokens, backward; under FSDP
   the gradients are reduced once, on the last micro-batch;
3. the ranks sum their counts, and the gradient is divided by the total of
   kept tokens: exactly the mean over unmasked tokens of the whole step,
   whatever the split (FSDP's reduction averages over ranks, hence the
   factor `world`);
4. clip the global norm, step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import torch

from colonnade.envs.base import SUCCESS_THRESHOLD, Success
from colonnade.protocol.metrics import TrainerRow, declared

from .advantages import group_advantages
from .batching import Packed, micro_inputs, pack
from .distributed import Dist
from .loss import GateConfig, dppo_loss
from .policy import as_policy, weights_as_published
from .samples import Sample

# The step's sums, in this order, reduced over ranks in one tensor.
TOKENS, KEPT, ABS_DIFF, KL, LOSS = range(5)


@dataclass(frozen=True)
class StepConfig:
    temperature: float = 1.0  # the workers' sampling temperature
    scale_by_std: bool = False
    micro_tokens: int = 8192  # padded tokens (rows × longest) per micro-batch
    max_grad_norm: float = 1.0
    gate: GateConfig = field(default_factory=GateConfig)
    # Run π on the weights as the workers receive them ("int8", "bf16"), the
    # gradient going to the fp32 masters; None: on the fp32 masters.
    published: str | None = None
    # The environment's rule for a solved episode (pass rate); the default is
    # what an environment declaring none gets: reward >= 1.
    success: Success = field(default_factory=lambda: Success(None, SUCCESS_THRESHOLD, False))


@dataclass(frozen=True)
class StepFigures:
    """What a step measured (rank 0): the step's part of the trainer's row
    (`protocol.metrics.TrainerRow`, whose comments say what each figure
    means), and the gate per behaviour version, which quarantine judges and
    no row carries."""

    loss: float
    reward_mean: float
    pass_rate: float
    groups: int
    groups_skipped: int
    episodes: int
    tokens: int
    micro_batches: int
    masked_fraction: float
    mean_abs_diff: float
    mismatch_kl: float
    grad_norm: float
    gate_by_worker: dict[str, dict[str, float]]  # worker -> tokens, kept, kl_sum
    env_metrics: dict[str, float]  # the environment's metric -> its mean over the episodes
    gate_by_version: dict[str, dict[str, dict[str, float]]]  # worker -> version -> the same

    def row_fields(self) -> dict:
        """The figures the trainer's row carries, by their row names."""
        return {name: getattr(self, name) for name in ROW_FIELDS}


# Every figure but gate_by_version is the row's, under the same name.
ROW_FIELDS = declared(
    [f.name for f in fields(StepFigures) if f.name != "gate_by_version"], (TrainerRow,)
)


def policy_logprobs(model, samples: Sequence[Sample], pad_id: int, temperature: float):
    """[B, G] log π of each sample's generated tokens, right-aligned (G = longest)."""
    policy = as_policy(model)
    device = next(policy.parameters()).device
    rows = [(s.ids, s.from_model, s.behaviour_logp, 0.0) for s in samples]
    x = micro_inputs(rows, pad_id, device)
    return policy(x.ids, x.mask, x.positions, x.targets, temperature if temperature > 0 else 1.0)


def _scored(groups: Sequence[Sequence[Sample]], cfg: StepConfig):
    """(rewards per group, skipped count, (sample, advantage) pairs to train on)."""
    rewards = [[s.score.reward for s in g] for g in groups]
    ga = group_advantages(rewards, scale_by_std=cfg.scale_by_std)
    # A skipped group has no advantages: it contributes no samples.
    pairs = [
        (s, a)
        for g, adv in zip(groups, ga.values, strict=True)
        if adv
        for s, a in zip(g, adv, strict=True)
    ]
    return rewards, ga.skipped, pairs


def _idle_pass(policy, pad_id: int, device) -> None:
    """A forward and backward that change nothing: a rank with fewer samples
    still joins FSDP's gathers and reductions."""
    ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
    ones = torch.ones_like(ids)
    (policy(ids, ones, ones.cumsum(-1) - 1, ids[:, -1:]).sum() * 0.0).backward()


def _accumulate(policy, packed: Packed, pad_id: int, cfg: StepConfig, where: Dist):
    """This rank's micro-batches, backward; (sums [5], per-sample [N, 3]) of
    tokens, kept tokens and Σ(log m − log p), for this rank's samples."""
    device = next(policy.parameters()).device
    sums = torch.zeros(5, dtype=torch.float64)
    rows = torch.zeros((packed.size, 3), dtype=torch.float64)
    n = packed.micro_count
    temperature = cfg.temperature if cfg.temperature > 0 else 1.0
    for j in range(n):
        if hasattr(policy, "set_requires_gradient_sync"):  # FSDP: reduce once, at the end
            policy.set_requires_gradient_sync(j == n - 1)
        idx = packed.micro(where.rank, j)
        if not idx:
            _idle_pass(policy, pad_id, device)
            continue
        x = micro_inputs(packed.rows(idx), pad_id, device)
        logp = policy(x.ids, x.mask, x.positions, x.targets, temperature)
        out = dppo_loss(logp, x.behaviour, x.adv, x.model_mask, cfg.gate)
        out.loss_sum.backward()
        sums += torch.tensor(
            [out.tokens, out.kept, out.mean_abs_diff * out.tokens, out.mismatch_kl * out.tokens,
             float(out.loss_sum.detach())], dtype=torch.float64,
        )  # fmt: skip
        if out.row_tokens is not None:  # None: no model tokens in the micro-batch
            rows[idx] = torch.tensor(
                list(zip(out.row_tokens, out.row_kept, out.row_kl_sum, strict=True)),
                dtype=torch.float64,
            )
    return sums, rows


def _update(policy, opt, kept: int, cfg: StepConfig, where: Dist) -> float:
    """Mean the gradient over the step's kept tokens, clip, step; the norm."""
    if not kept:
        return 0.0
    scale = where.world / kept
    for p in policy.parameters():
        if p.grad is not None:
            p.grad.mul_(scale)
    norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor under FSDP
        norm = norm.full_tensor()
    opt.step()
    return float(norm)


def train_step(
    model,
    opt,
    groups: Sequence[Sequence[Sample]] | None,
    pad_id: int,
    cfg: StepConfig,
    where: Dist | None = None,
) -> StepFigures | None:
    """Update the model on these groups; the step's figures (on rank 0).

    Rank 0 passes the groups; the other ranks pass None, receive their
    share, and get None back.
    """
    where = where or Dist()
    policy = as_policy(model)
    packed = None
    if where.leader:
        rewards, skipped, pairs = _scored(groups, cfg)
        env_means = env_metric_means(s.score.metrics for g in groups for s in g)
        solved = sum(cfg.success(s.score) for g in groups for s in g)
        packed = pack(pairs, cfg.micro_tokens, where.world)
    ts = where.broadcast(packed.tensors() if packed else None, Packed.dtypes())
    packed = Packed.from_tensors(ts)
    policy.train()
    opt.zero_grad(set_to_none=True)
    as_published = (
        weights_as_published(policy, cfg.published) if cfg.published else contextlib.nullcontext()
    )
    with as_published:
        sums, rows = _accumulate(policy, packed, pad_id, cfg, where)
    sums, rows = where.all_reduce_sum(sums), where.all_reduce_sum(rows)
    grad_norm = _update(policy, opt, int(sums[KEPT]), cfg, where)
    policy.eval()
    if not where.leader:
        return None
    samples = [s for s, _ in pairs]
    return _metrics(rewards, solved, skipped, samples, sums, rows, grad_norm, packed, env_means)


MAX_ENV_METRICS = 32  # a row carries at most this many of the environment's metrics


def env_metric_means(episodes) -> dict[str, float]:
    """The mean of each metric over the episodes that return it (`Score.metrics`
    of each), for the trainer's row: the first `MAX_ENV_METRICS` names seen."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for metrics in episodes:
        for name, value in metrics.items():
            if name not in sums and len(sums) >= MAX_ENV_METRICS:
                continue
            number = isinstance(value, int | float) and not isinstance(value, bool)
            if number and math.isfinite(value):
                sums[name] = sums.get(name, 0.0) + float(value)
                counts[name] = counts.get(name, 0) + 1
    return {name: round(sums[name] / counts[name], 4) for name in sums}


def _metrics(
    rewards,
    solved: int,
    skipped,
    samples,
    sums,
    rows,
    grad_norm,
    packed: Packed,
    env_means: dict[str, float],
) -> StepFigures:
    tokens, kept = int(sums[TOKENS]), int(sums[KEPT])
    per_worker: dict[str, dict[str, float]] = {}
    by_version: dict[str, dict[str, dict[str, float]]] = {}  # worker -> version -> stats
    _add_rows(per_worker, by_version, samples, rows)
    all_rewards = [r for g in rewards for r in g]
    return StepFigures(
        loss=float(sums[LOSS]) / kept if kept else 0.0,
        reward_mean=sum(all_rewards) / max(1, len(all_rewards)),
        pass_rate=solved / max(1, len(all_rewards)),
        groups=len(rewards),
        groups_skipped=skipped,
        episodes=len(all_rewards),
        tokens=tokens,
        micro_batches=packed.micro_count,
        masked_fraction=1.0 - kept / tokens if tokens else 0.0,
        mean_abs_diff=float(sums[ABS_DIFF]) / tokens if tokens else 0.0,
        mismatch_kl=float(sums[KL]) / tokens if tokens else 0.0,
        grad_norm=grad_norm,
        gate_by_worker=per_worker,
        env_metrics=env_means,
        gate_by_version=by_version,  # for quarantine's like-for-like comparison
    )


def _add_rows(per_worker: dict, by_version: dict, samples: Sequence[Sample], rows) -> None:
    """Sum the per-sample gate figures into {worker: tokens, kept, kl_sum}, and
    per behaviour version into {worker: {version: ...}}."""
    for s, (n, k, kl) in zip(samples, rows.tolist(), strict=True):
        per_v = by_version.setdefault(s.worker, {})
        for w in (per_worker.setdefault(s.worker, {}), per_v.setdefault(str(s.version), {})):
            w["tokens"] = w.get("tokens", 0) + int(n)
            w["kept"] = w.get("kept", 0) + int(k)
            w["kl_sum"] = w.get("kl_sum", 0.0) + float(kl)


def warmup_lr(lr: float, version: int, warmup: int) -> float:
    """The rate of the update that makes version + 1: linear up to `lr` over
    `warmup` versions (a function of the version, so a resumed run goes on
    where it was)."""
    return lr * min(1.0, (version + 1) / warmup) if warmup > 0 else lr
