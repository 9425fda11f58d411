"""Rewards the trainer cannot recompute, and the workers whose word it takes for them.

The trainer rebuilds every episode it trains on and scores it itself
(samples.py): a worker's claimed reward is never used. An environment that
runs its own loop on the worker (`vf:NAME`, envs/verifiers.py) cannot be
replayed that way: its tools may reach the network, its rubric may call a
judge model, and the trainer sees only the tokens. For such an environment
each episode's reward is one of:

- recomputed: the environment declares a local rubric (one that scores from
  the prompt and the completion alone) and the episode is one model turn
  with no environment text in it; the trainer scores the decoded turn
  itself, as for any other environment, and the worker's reward is ignored;
- trusted: otherwise, the reward the worker sent (protocol 9,
  `GroupRecord.rewards`), taken only from a worker the operator trusts:
  its id among `--trusted-keys`, with the same public key the run
  registered for it (`--worker-keys`: a signed run, so the id is proven).
  A group from any other worker is rejected (`groups_rejected_untrusted`).

Tool results and environment text inside a trusted episode are taken as
sent too: what that gives up is in docs/security.md. Every sample records
which rule gave its reward (`Sample.reward_from`); the collector counts
episodes of each (`rewards_recomputed`, `rewards_trusted`), which the
trainer's rows and the report show.
"""

from __future__ import annotations

from collections.abc import Mapping

from colonnade.envs import Score
from colonnade.protocol import GroupRecord
from colonnade.protocol.turns import chat_prompt, model_turns

RECOMPUTED, TRUSTED = "recomputed", "trusted"
UNTRUSTED = "untrusted"  # the reason a group is rejected under this rule


def rebuild_worker_group(
    tokenizer, env, group: GroupRecord, version: int, stop, max_len: int, train_ids: set[str]
) -> list:
    """The samples of a group of a worker-run environment, each reward
    recomputed where the environment lets it, else the worker's (marked
    `TRUSTED`: the collector keeps it only from a trusted worker)."""
    from .samples import Rejected, Sample, _segments

    if group.task_id not in train_ids:
        raise Rejected(f"task {group.task_id!r} is not a training task")
    task = env.task(group.task_id)
    prompt = chat_prompt(tokenizer, env.prompt(task))
    out = []
    for i, ep in enumerate(group.episodes):
        if len(prompt) + len(ep.tokens) > max_len:
            raise Rejected(f"episode of {len(prompt) + len(ep.tokens)} tokens exceeds {max_len}")
        turns = model_turns(tokenizer, ep.tokens, ep.from_model, stop)
        if len(turns) > env.max_turns:
            raise Rejected(f"{len(turns)} model turns, more than the environment's {env.max_turns}")
        added = sum(not mine for mine, _, _ in _segments(ep.from_model))
        if env.rescorable(len(turns), added):
            score, source = env.score(task, turns), RECOMPUTED
        elif group.rewards is None:
            raise Rejected("no reward sent, and the environment's cannot be recomputed")
        else:
            score, source = Score(float(group.rewards[i]), {}), TRUSTED
        out.append(Sample(group.task_id, version, len(prompt), prompt + list(ep.tokens),
                          list(ep.from_model), list(ep.logprobs), score,
                          reward_from=source))  # fmt: skip
    return out


def trusts(worker: str, trusted: Mapping | None, keyring: Mapping | None) -> bool:
    """Whether `worker`'s word on a reward is taken: the operator trusts its
    key, and the run's keyring proves the batch came from that key."""
    if not trusted or keyring is None or worker not in trusted or worker not in keyring:
        return False
    return _raw(trusted[worker]) == _raw(keyring[worker])


def _raw(key) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def untrusted(samples: list, worker: str, trusted: Mapping | None, keyring: Mapping | None):
    """Why the collector must reject these samples of `worker`, or None."""
    if any(s.reward_from == TRUSTED for s in samples) and not trusts(worker, trusted, keyring):
        return (
            f"rewards the trainer cannot recompute, from {worker}, which is not among "
            "the trusted keys (--trusted-keys)"
        )
    return None


def count(samples: list, counts) -> None:
    """Add the samples' episodes to the counters of each rule."""
    for s in samples:
        counts[f"rewards_{s.reward_from}"] += 1
