"""One RL step: advantages per group, π's log-probs, the DPPO loss, AdamW.

Sequences are left-padded so that every row's generated tokens sit at the
end: only those positions' logits are computed (`logits_to_keep`), which
spares the prompt's share of the vocabulary projection. The loss is summed
over micro-batches and the gradient divided by the total of kept tokens at
the end, which is exactly the mean over unmasked tokens of the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from colonnade.model.logprobs import gather_logprobs

from .advantages import group_advantages
from .loss import GateConfig, dppo_loss
from .samples import Sample


@dataclass(frozen=True)
class StepConfig:
    temperature: float = 1.0  # the workers' sampling temperature
    scale_by_std: bool = False
    micro_batch: int = 8
    max_grad_norm: float = 1.0
    gate: GateConfig = field(default_factory=GateConfig)


def left_pad(samples: Sequence[Sample], pad_id: int, device) -> tuple[torch.Tensor, ...]:
    width = max(len(s.ids) for s in samples)
    ids = torch.full((len(samples), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), width), dtype=torch.long)
    for r, s in enumerate(samples):
        ids[r, width - len(s.ids) :] = torch.tensor(s.ids)
        mask[r, width - len(s.ids) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids.to(device), mask.to(device), positions.to(device)


def policy_logprobs(model, samples: Sequence[Sample], pad_id: int, temperature: float):
    """[B, G] log π of each sample's generated tokens, right-aligned (G = longest)."""
    device = next(model.parameters()).device
    ids, mask, positions = left_pad(samples, pad_id, device)
    gen = max(len(s.ids) - s.prompt_len for s in samples)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=gen + 1)
    logits = out.logits[:, :-1]  # position t predicts token t+1
    return gather_logprobs(logits, ids[:, -gen:], temperature if temperature > 0 else 1.0)


def _aligned(samples: Sequence[Sample], adv: Sequence[float], gen: int):
    """Behaviour log-probs, advantages and model masks, right-aligned to `gen`."""
    b = len(samples)
    mu = torch.zeros((b, gen), dtype=torch.float32)
    a = torch.zeros((b, gen), dtype=torch.float32)
    model = torch.zeros((b, gen), dtype=torch.bool)
    for r, (s, adv_r) in enumerate(zip(samples, adv, strict=True)):
        n = len(s.from_model)
        mu[r, gen - n :] = torch.tensor(s.behaviour_logp)
        model[r, gen - n :] = torch.tensor(s.from_model)
        a[r, gen - n :] = adv_r
    return mu, a, model


def train_step(model, opt, groups: Sequence[Sequence[Sample]], pad_id: int, cfg: StepConfig):
    """Update `model` on these groups; the step's metrics."""
    rewards = [[s.score.reward for s in g] for g in groups]
    ga = group_advantages(rewards, scale_by_std=cfg.scale_by_std)
    # A skipped group has no advantages: it contributes no samples.
    pairs = [
        (s, a)
        for g, adv in zip(groups, ga.values, strict=True)
        if adv
        for s, a in zip(g, adv, strict=True)
    ]
    totals = {"tokens": 0, "kept": 0, "abs_diff": 0.0, "kl": 0.0, "loss": 0.0}
    per_worker: dict[str, dict[str, float]] = {}
    by_version: dict[str, dict[str, dict[str, float]]] = {}  # worker -> version -> stats
    model.train()
    opt.zero_grad(set_to_none=True)
    device = next(model.parameters()).device
    for start in range(0, len(pairs), cfg.micro_batch):
        chunk = pairs[start : start + cfg.micro_batch]
        samples = [s for s, _ in chunk]
        logp = policy_logprobs(model, samples, pad_id, cfg.temperature)
        mu, a, mm = (t.to(device) for t in _aligned(samples, [x for _, x in chunk], logp.shape[1]))
        out = dppo_loss(logp, mu, a, mm, cfg.gate)
        out.loss_sum.backward()
        totals["tokens"] += out.tokens
        totals["kept"] += out.kept
        totals["abs_diff"] += out.mean_abs_diff * out.tokens
        totals["kl"] += out.mismatch_kl * out.tokens
        totals["loss"] += float(out.loss_sum.detach())
        _add_rows(per_worker, by_version, samples, out)
    kept, tokens = totals["kept"], totals["tokens"]
    grad_norm = 0.0
    if kept:
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= kept
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm))
        opt.step()
    model.eval()
    all_rewards = [r for g in rewards for r in g]
    return {
        "loss": totals["loss"] / kept if kept else 0.0,
        "reward_mean": sum(all_rewards) / max(1, len(all_rewards)),
        "pass_rate": sum(r > 0 for r in all_rewards) / max(1, len(all_rewards)),
        "groups": len(groups),
        "groups_skipped": ga.skipped,
        "episodes": len(all_rewards),
        "tokens": tokens,
        "masked_fraction": 1.0 - kept / tokens if tokens else 0.0,
        "mean_abs_diff": totals["abs_diff"] / tokens if tokens else 0.0,
        "mismatch_kl": totals["kl"] / tokens if tokens else 0.0,
        "grad_norm": grad_norm,
        "gate_by_worker": per_worker,
        "gate_by_version": by_version,  # for quarantine's like-for-like comparison
    }


def _add_rows(per_worker: dict, by_version: dict, samples: Sequence[Sample], out) -> None:
    """Sum a micro-batch's per-row gate figures into {worker: tokens, kept, kl_sum},
    and per behaviour version into {worker: {version: ...}}."""
    for s, n, k, kl in zip(samples, out.row_tokens, out.row_kept, out.row_kl_sum, strict=True):
        per_v = by_version.setdefault(s.worker, {})
        for w in (per_worker.setdefault(s.worker, {}), per_v.setdefault(str(s.version), {})):
            w["tokens"] = w.get("tokens", 0) + int(n)
            w["kept"] = w.get("kept", 0) + int(k)
            w["kl_sum"] = w.get("kl_sum", 0.0) + float(kl)
