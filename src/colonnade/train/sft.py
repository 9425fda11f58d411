"""Supervised fine-tuning on token sequences with a loss mask.

An example is the token ids of one whole episode (prompt, model turns, tool
replies) and a mask that is True where the model wrote the token: only those
positions are learned, as in RL, so tool output is never imitated.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from colonnade.envs import Demonstrating, Environment, Task
from colonnade.protocol.turns import chat_format, chat_reply, task_prompt


@dataclass(frozen=True)
class Example:
    ids: tuple[int, ...]
    learn: tuple[bool, ...]  # True where the model wrote the token


def _reply(tokenizer, env: Environment, task: Task, turns: list[str]) -> str | None:
    if chat_format(env):
        return chat_reply(tokenizer, env, task, turns)
    return env.respond(task, turns)


def episode_example(tokenizer, env: Environment, task: Task, turns: Sequence[str]) -> Example:
    """Tokens of an episode made of these model turns, replies from `env`.

    Each piece is tokenized on its own, as the engine sees it: prompt ids,
    then model turn, tool reply, model turn, ...
    """
    ids = list(task_prompt(tokenizer, env, task))
    learn = [False] * len(ids)
    for i, turn in enumerate(turns):
        piece = tokenizer.encode(turn, add_special_tokens=False)
        ids += piece
        learn += [True] * len(piece)
        reply = _reply(tokenizer, env, task, list(turns[: i + 1]))
        if reply is None:
            break
        piece = tokenizer.encode(reply, add_special_tokens=False)
        ids += piece
        learn += [False] * len(piece)
    return Example(tuple(ids), tuple(learn))


def demonstrations(
    tokenizer, env: Environment, tasks: Sequence[Task], good_fraction: float, seed: int
) -> list[Example]:
    """One demo per task; a `good_fraction` share of them good, chosen by the seed."""
    if not isinstance(env, Demonstrating):
        raise TypeError(f"environment {env.name!r} has no demonstration() for a warm start")
    if not 0.0 <= good_fraction <= 1.0:
        raise ValueError("good_fraction must be within [0, 1]")
    rng = random.Random(seed)
    out = []
    for task in tasks:
        good = rng.random() < good_fraction
        out.append(episode_example(tokenizer, env, task, env.demonstration(task, good, rng)))
    return out


def copy_drill(tokenizer, texts: Sequence[str], n: int, seed: int) -> list[Example]:
    """n copy exercises: a window of 6-20 tokens of `texts`, an end token, the window again.

    Only the second copy is learned. A model trained from scratch on a task's
    demonstrations never learns to copy an unseen name (a query from the
    question, an answer from a retrieved document): the few name tokens are a
    sliver of its loss, and it memorizes the training names instead. Dense
    copying forms the induction circuit in a few hundred steps, and the task's
    demonstrations then only have to point it at the right span.
    """
    if not texts:
        raise ValueError("no texts to draw copy exercises from")
    rng = random.Random(seed)
    docs = [tokenizer.encode(" " + t, add_special_tokens=False) for t in texts]
    docs = [d for d in docs if d]
    out = []
    for _ in range(n):
        doc = rng.choice(docs)
        width = min(len(doc), rng.randint(6, 20))
        start = rng.randint(0, len(doc) - width)
        window = doc[start : start + width]
        ids = (*window, tokenizer.eos_token_id, *window)
        out.append(Example(ids, (False,) * (width + 1) + (True,) * width))
    return out


def collate(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, ...]:
    """(ids, attention mask, labels) right-padded; labels are -100 where not learned."""
    width = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    for r, e in enumerate(batch):
        n = len(e.ids)
        ids[r, :n] = torch.tensor(e.ids)
        attn[r, :n] = 1
        labels[r, :n] = torch.where(torch.tensor(e.learn), ids[r, :n], -100)
    return ids, attn, labels


def masked_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over the learned positions."""
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100
    )


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to a tenth of `lr`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train_sft(
    model,
    examples: Sequence[Example],
    pad_id: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int = 0,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """AdamW over shuffled batches of `examples`; the loss of every step."""
    if not examples:
        raise ValueError("no examples to train on")
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.98))
    model.train()
    losses, order = [], []
    for step in range(steps):
        if len(order) < batch_size:
            order += torch.randperm(len(examples), generator=gen).tolist()
        batch, order = [examples[i] for i in order[:batch_size]], order[batch_size:]
        ids, attn, labels = collate(batch, pad_id)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        loss = masked_lm_loss(model(input_ids=ids, attention_mask=attn).logits, labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if progress:
            progress(step + 1, losses[-1])
    model.eval()
    return losses
