"""Teacher-forced token log-probs: what π or μ assigned to given tokens."""

from __future__ import annotations

import torch


def gather_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0):
    """log softmax(logits / T)[target] per position; logits [.., T, V], targets [.., T]."""
    z = logits.float()
    if temperature not in (0.0, 1.0):
        z = z / temperature
    return torch.log_softmax(z, dim=-1).gather(-1, targets[..., None]).squeeze(-1)


def sequence_logprobs(model, ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs of ids[start:] given their prefixes, in one forward pass."""
    if not 0 < start < len(ids):
        raise ValueError("start must leave a prefix and at least one scored token")
    device = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=device)
    logits = model(input_ids=x).logits[0, start - 1 : -1]
    return gather_logprobs(logits, x[0, start:], temperature).cpu()
