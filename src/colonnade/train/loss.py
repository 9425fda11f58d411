"""The DPPO gate and the policy-gradient loss over stale, quantized rollouts.

Per model token, p = π(token) under the trainer's current weights and
m = μ(token) under the weights the worker ran. The gate masks a token when
the update would push further in the direction the policy already moved
too far: A > 0 and p − m > δ_high, or A < 0 and p − m < −δ_low (an absolute
difference of probabilities, one-sided by the sign of A). The loss is
−A · sg(min(p/m, c)) · mask · log p, averaged over unmasked model tokens;
tool tokens never count.
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
