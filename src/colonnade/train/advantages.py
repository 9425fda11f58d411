"""GRPO group advantages: each episode's reward against its group's mean."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupAdvantages:
    values: list[list[float]]  # per group, per episode; empty for a skipped group
    skipped: int  # groups whose rewards were all equal (no signal)


def group_advantages(
    rewards: Sequence[Sequence[float]], scale_by_std: bool = False, eps: float = 1e-6
) -> GroupAdvantages:
    """A_i = r_i - mean(r) per group, optionally divided by the group's std.

    A group whose rewards are all equal has every advantage zero: it costs a
    backward pass and teaches nothing, so it is returned empty and counted.
    """
    out, skipped = [], 0
    for group in rewards:
        if not group:
            raise ValueError("empty group")
        mean = sum(group) / len(group)
        if max(group) - min(group) <= eps:
            out.append([])
            skipped += 1
            continue
        adv = [r - mean for r in group]
        if scale_by_std:
            std = (sum(a * a for a in adv) / len(adv)) ** 0.5
            adv = [a / (std + eps) for a in adv]
        out.append(adv)
    return GroupAdvantages(out, skipped)
