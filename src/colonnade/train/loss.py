"""The RL loss: DPPO's binary-TV gate over stale, quantized rollouts.

What it is: DPPO, "Rethinking the Trust Region in LLM Reinforcement
Learning" (arXiv 2602.04879), in its Binary-TV form. PPO's trust region is a
ratio clip; DPPO's is a mask on the divergence between the policy that
sampled a token and the one being trained, per token, here the absolute
difference of the two probabilities (a one-token total-variation term). It
suits colonnade because the gap it bounds is exactly what staleness and
int8 weights open between a worker and the trainer.

Per model token, p = π(token) under the trainer's current weights and
m = μ(token) under the weights the worker ran (the recorded behaviour
log-prob). The gate masks a token when the update would push further in
the direction the policy already moved too far: A > 0 and p − m > δ_high,
or A < 0 and p − m < −δ_low (one-sided by the sign of the advantage A). The
loss is −A · sg(min(p/m, c)) · mask · log p, summed over kept model tokens
and divided by their number; tool tokens and padding never count.

Shapes: `dppo_loss` takes logp, behaviour_logp, adv and model_mask of one
shape, either flat [T] or [rows, T] (rows: episodes of a micro-batch, T:
their padded length); adv is each episode's advantage repeated over its
tokens. The scalar loss is differentiable through logp only: p, m and the
ratio are constants (sg), so the gradient is that of a weighted
log-likelihood.

How it differs from prime-rl's default loss (its DPPO-TV variant): the
same kind of TV mask, but prime-rl also clamps the importance ratio inside
a PPO-style surrogate and adds a KL penalty term. Here the ratio only
weights the token (capped at c, as a variance bound; no surrogate min), and
there is no KL term: the mismatch KL is measured (`mismatch_kl`), not
optimised, and the gate alone keeps the update inside the trust region.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GateConfig:
    delta_low: float = 0.15
    delta_high: float = 0.15
    clip: float = 2.0  # c: cap on the importance ratio p/m


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, differentiable through log p
    masked_fraction: float  # of model tokens
    mean_abs_diff: float  # mean |p − m| over model tokens
    mismatch_kl: float  # mean of log m − log p over model tokens (k1 estimate of KL(μ‖π))
    tokens: int  # model tokens considered
    kept: int = 0  # model tokens the gate let through
    loss_sum: torch.Tensor | None = None  # loss · kept: sums across micro-batches
    # Per row (dim 0) of 2-D inputs: model tokens, kept tokens, sum of log m − log p.
    # The trainer sums them per worker to spot one whose log-probs do not fit.
    row_tokens: list[int] | None = None
    row_kept: list[int] | None = None
    row_kl_sum: list[float] | None = None


def dppo_mask(p: torch.Tensor, m: torch.Tensor, adv: torch.Tensor, cfg: GateConfig):
    """True where a token stays in the loss."""
    diff = p - m
    too_high = (adv > 0) & (diff > cfg.delta_high)
    too_low = (adv < 0) & (diff < -cfg.delta_low)
    return ~(too_high | too_low)


def dppo_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    adv: torch.Tensor,
    model_mask: torch.Tensor,
    cfg: GateConfig | None = None,
) -> LossOut:
    """Loss and gate statistics over tokens (any shape, all four alike).

    `adv` is the episode's advantage broadcast to its tokens; `model_mask`
    is True on tokens the model wrote (False on tool output and padding).
    """
    cfg = cfg or GateConfig()
    model_mask = model_mask.bool()
    n = int(model_mask.sum())
    if n == 0:
        zero = logp.sum() * 0.0
        return LossOut(zero, 0.0, 0.0, 0.0, 0, 0, zero)
    p = logp.detach().exp()
    m = behaviour_logp.exp()
    keep = dppo_mask(p, m, adv, cfg) & model_mask
    ratio = torch.clamp(p / m.clamp_min(1e-12), max=cfg.clip)
    per_token = -adv * ratio * logp
    kept = int(keep.sum())
    loss_sum = (per_token * keep).sum()
    loss = loss_sum / max(kept, 1)
    sel = model_mask
    rows = {}
    if logp.dim() == 2:
        gap = (behaviour_logp - logp.detach()) * model_mask
        rows = dict(
            row_tokens=model_mask.sum(1).tolist(),
            row_kept=keep.sum(1).tolist(),
            row_kl_sum=gap.sum(1).tolist(),
        )
    return LossOut(
        loss=loss,
        masked_fraction=1.0 - kept / n,
        mean_abs_diff=float((p - m).abs()[sel].mean()),
        mismatch_kl=float((behaviour_logp - logp.detach())[sel].mean()),
        tokens=n,
        kept=kept,
        loss_sum=loss_sum,
        **rows,
    )
