"""Who trains on what in a step: micro-batches by a token budget, dealt to ranks.

Samples are sorted by length, longest first, and packed greedily into
micro-batches whose padded size (rows × the longest row) stays within
`micro_tokens`; a sample longer than the budget gets a micro-batch of its
own. Sorting keeps padding small: rows of similar length travel together.
The micro-batches are then dealt to ranks, largest first to the least
loaded, and every rank gets the same number of them (empty ones added):
FSDP's gathers and reductions need every rank in every forward and backward.

`Packed` holds a step's samples as flat tensors, which is how rank 0 hands
them to the other ranks (`Dist.broadcast`): token ids, lengths, the model
mask, behaviour log-probs and advantages, plus each sample's (rank,
micro-batch) slot. Every rank rebuilds its own micro-batches from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .samples import Sample


def plan_micro_batches(
    lengths: Sequence[int], micro_tokens: int, ranks: int = 1
) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of sample indices; equal counts."""
    if micro_tokens < 1 or ranks < 1:
        raise ValueError("micro_tokens and ranks must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Sorted longest first: a batch's first row is its widest.
        if batches and lengths[batches[-1][0]] * (len(batches[-1]) + 1) <= micro_tokens:
            batches[-1].append(i)
        else:
            batches.append([i])
    per_rank: list[list[list[int]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for b in sorted(batches, key=lambda b: -lengths[b[0]] * len(b)):
        r = min(range(ranks), key=lambda k: (load[k], k))
        per_rank[r].append(b)
        load[r] += lengths[b[0]] * len(b)
    count = max((len(p) for p in per_rank), default=0)
    for p in per_rank:
        p.extend([] for _ in range(count - len(p)))
    return per_rank


_DTYPES = [torch.int64, torch.int64, torch.int64, torch.bool, torch.float32, torch.float32,
           torch.int64]  # fmt: skip


@dataclass
class Packed:
    """A step's samples as flat tensors (the same on every rank)."""

    ids: torch.Tensor  # int64, every sample's ids (prompt + generated) concatenated
    lengths: torch.Tensor  # int64 [N]: len(ids) per sample
    gen: torch.Tensor  # int64 [N]: generated tokens per sample
    from_model: torch.Tensor  # bool, over the generated tokens, concatenated
    behaviour: torch.Tensor  # float32, behaviour log-probs over the generated tokens
    adv: torch.Tensor  # float32 [N]: the sample's advantage
    slot: torch.Tensor  # int64 [N * 2]: (rank, micro-batch index) per sample

    def tensors(self) -> list[torch.Tensor]:
        return [self.ids, self.lengths, self.gen, self.from_model, self.behaviour, self.adv,
                self.slot]  # fmt: skip

    @classmethod
    def from_tensors(cls, ts: list[torch.Tensor]) -> Packed:
        return cls(*ts)

    @staticmethod
    def dtypes() -> list[torch.dtype]:
        return list(_DTYPES)

    @property
    def size(self) -> int:
        return int(self.lengths.numel())

    @property
    def micro_count(self) -> int:
        """Micro-batches per rank (every rank has as many)."""
        return int(self.slot.view(-1, 2)[:, 1].max()) + 1 if self.size else 0

    def micro(self, rank: int, j: int) -> list[int]:
        """Indices of the samples in rank `rank`'s micro-batch `j` (maybe none)."""
        slot = self.slot.view(-1, 2)
        hit = (slot[:, 0] == rank) & (slot[:, 1] == j)
        return hit.nonzero().flatten().tolist()

    def rows(self, idx: Sequence[int]) -> list[tuple[list[int], list[bool], list[float], float]]:
        """(ids, from_model, behaviour log-probs, advantage) of these samples."""
        id_end = self.lengths.cumsum(0)
        gen_end = self.gen.cumsum(0)
        out = []
        for i in idx:
            a, b = int(id_end[i] - self.lengths[i]), int(id_end[i])
            c, d = int(gen_end[i] - self.gen[i]), int(gen_end[i])
            out.append(
                (
                    self.ids[a:b].tolist(),
                    self.from_model[c:d].tolist(),
                    self.behaviour[c:d].tolist(),
                    float(self.adv[i]),
                )
            )
        return out


def pack(pairs: Sequence[tuple[Sample, float]], micro_tokens: int, ranks: int = 1) -> Packed:
    """The (sample, advantage) pairs of a step, planned for `ranks` ranks."""
    samples = [s for s, _ in pairs]
    plan = plan_micro_batches([len(s.ids) for s in samples], micro_tokens, ranks)
    slot = torch.zeros((len(samples), 2), dtype=torch.int64)
    for r, batches in enumerate(plan):
        for j, batch in enumerate(batches):
            for i in batch:
                slot[i] = torch.tensor([r, j])
    return Packed(
        ids=torch.tensor([t for s in samples for t in s.ids], dtype=torch.int64),
        lengths=torch.tensor([len(s.ids) for s in samples], dtype=torch.int64),
        gen=torch.tensor([len(s.from_model) for s in samples], dtype=torch.int64),
        from_model=torch.tensor([m for s in samples for m in s.from_model], dtype=torch.bool),
        behaviour=torch.tensor([x for s in samples for x in s.behaviour_logp], dtype=torch.float32),
        adv=torch.tensor([a for _, a in pairs], dtype=torch.float32),
        slot=slot.flatten(),
    )


@dataclass
class MicroInputs:
    """One micro-batch, left-padded so every row's generated tokens end the row."""

    ids: torch.Tensor  # [B, T]
    mask: torch.Tensor  # [B, T]
    positions: torch.Tensor  # [B, T]
    targets: torch.Tensor  # [B, G]: the last G ids (G = longest generation)
    behaviour: torch.Tensor  # [B, G] float32, right-aligned
    adv: torch.Tensor  # [B, G] float32, the row's advantage on its tokens
    model_mask: torch.Tensor  # [B, G] bool: tokens the model wrote


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, positions) [B, T] of rows padded on the left."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(list(r), dtype=torch.long)
        mask[i, width - len(r) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    return ids, mask, positions


def micro_inputs(rows, pad_id: int, device) -> MicroInputs:
    """`rows` as from Packed.rows, ready for Policy.forward and dppo_loss."""
    ids, mask, positions = left_pad([r[0] for r in rows], pad_id)
    gen = max(len(r[1]) for r in rows)
    b = len(rows)
    mu = torch.zeros((b, gen), dtype=torch.float32)
    adv = torch.zeros((b, gen), dtype=torch.float32)
    model = torch.zeros((b, gen), dtype=torch.bool)
    for i, (_, from_model, behaviour, a) in enumerate(rows):
        n = len(from_model)
        mu[i, gen - n :] = torch.tensor(behaviour)
        model[i, gen - n :] = torch.tensor(from_model)
        adv[i, gen - n :] = a
    on = [t.to(device) for t in (ids, mask, positions, mu, adv, model)]
    return MicroInputs(on[0], on[1], on[2], on[0][:, -gen:], on[3], on[4], on[5])
