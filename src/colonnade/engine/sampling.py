"""Choosing the next token, and the log-prob the trainer's gate needs.

Every sampled token is the inverse CDF, over the vocabulary in token-id
order, of a draw the engine is handed (`protocol.draws`): the same draw gives
the same token on every engine except within rounding of a boundary, and
the mass below the token (recorded beside its log-prob) lets the trainer
check that the draw falls in the token's interval.

The recorded log-prob is that of the distribution actually sampled from:
after temperature, top-k and top-p, renormalized. A trainer must apply the
same temperature when it recomputes π (top-k/top-p truncation is why they
are off by default: they make μ differ from any π the trainer computes).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from colonnade.protocol.turns import SamplingParams


def filtered_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probs [B, V] of the sampling distribution (tempered, truncated)."""
    z = logits.float()
    if params.temperature == 0:
        return torch.log_softmax(z, dim=-1)
    z = z / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = torch.topk(z, params.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, dim=-1)
        # Drop a token when the mass before it already reaches top_p; the
        # most likely token always stays.
        drop = (torch.cumsum(probs, dim=-1) - probs) >= params.top_p
        z = z.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.log_softmax(z, dim=-1)


class Draw(NamedTuple):
    """One step's sampled tokens [B] (int64), their log-probs [B] (float32) and
    the probability mass below each in token-id order [B] (float64)."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    below: torch.Tensor


def sample(logits: torch.Tensor, params: SamplingParams, draws: np.ndarray) -> Draw:
    """Tokens for next-token logits [B, V], row b's drawn by `draws[b]` in [0, 1)
    (`protocol.draws`): the inverse CDF over the vocabulary in token-id order.
    Sums in float64, so the drawn frequencies match the probabilities the
    recorded log-prob names."""
    logp = filtered_logprobs(logits.detach().to("cpu"), params)
    if params.temperature == 0:
        tokens = logp.argmax(dim=-1)
    else:
        probs = logp.exp().double()
        cdf = probs.cumsum(dim=-1)
        u = torch.from_numpy(np.asarray(draws, dtype=np.float64))[:, None]
        # `right=True` never lands on a zero-probability (filtered) token, even
        # for u = 0; a product that rounds up to the total takes the last
        # token that has any mass.
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
        tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).minimum(last)
    chosen = logp.gather(-1, tokens[:, None]).squeeze(-1)
    return Draw(tokens, chosen, mass_below(logp, tokens))


def mass_below(logp: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """float64 [N]: the probability mass of the ids below each token, for
    log-probs [N, V] (`filtered_logprobs`) and tokens [N]: where the token's
    interval of draws starts."""
    cdf = logp.exp().double().cumsum(dim=-1)
    prev = cdf.gather(-1, (tokens - 1).clamp(min=0)[:, None]).squeeze(-1)
    return torch.where(tokens > 0, prev, 0.0) / cdf[:, -1]
