"""The trainer's side of a tool service: signed replies checked instead of replayed.

A served environment's replies cannot be replayed (the trainer holds no
index, and the service may not answer the same twice), so a worker sends
the service's signed replies with its batch and the trainer checks them in
two places:

- `misbound` (the collector, per batch): every reply was asked for this run,
  for its group's task and for its own row (the episode's draw key, which
  commits to run, version, worker, claim slot, task and row). A reply
  moved from another episode, batch, worker or run fails here, and the
  batch is refused (`rejected_tool_reply`).
- `Answers` (the replay, per episode): the reply to each served turn
  answers that turn's query (the environment's `tool_query`, recomputed),
  is signed by the run's pinned service key over the call and result as
  sent, and its text (`tool_reply` of the result) is the episode's tokens.
  An altered result, a reply to another query, a missing or an extra one
  refuses the group (`groups_rejected_tool_reply`); an episode whose
  service gave no reply (`tool`) refuses it too, never training it on a
  reward the outage decided (`groups_rejected_tool_failed`).

What the signature proves, and what it does not: docs/environments.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from colonnade.envs import Environment
from colonnade.protocol import EpisodeRecord
from colonnade.protocol.draws import draw_key
from colonnade.protocol.schemas import RolloutBatch
from colonnade.tools.served import served
from colonnade.tools.signed import ReplyRejected, public_key


class ToolRejected(ValueError):
    """An episode whose tool replies are not the service's own; `reason`
    names the count (collect.py)."""

    def __init__(self, what: str, reason: str = "tool_reply"):
        super().__init__(what)
        self.reason = reason


def misbound(batch: RolloutBatch, run_id: str) -> str | None:
    """Why a signed reply in `batch` was not asked for where it stands, or None."""
    for g in batch.groups:
        for row, ep in enumerate(g.episodes):
            if not ep.tools:
                continue
            key = draw_key(run_id, batch.version, batch.worker, batch.slot, g.task_id, row).hex()
            for r in ep.tools:
                call = r.call
                if (call.run, call.task, call.row) != (run_id, g.task_id, key):
                    return (f"a reply in {g.task_id[:64]} row {row} was asked for run "
                            f"{call.run[:16]!r}, task {call.task[:64]!r}, row {call.row[:12]}…, "
                            "not this episode's")  # fmt: skip
    return None


class Answers:
    """One episode's replies as the trainer takes them: a served turn's from
    its signed reply, any other from the environment (replayed)."""

    def __init__(self, env: Environment, task, ep: EpisodeRecord):
        self.env, self.task = env, task
        if ep.finish == "tool":
            raise ToolRejected("the episode's tool service gave no reply", "tool_failed")
        self.served = served(env)
        if ep.tools and not self.served:
            raise ToolRejected(f"signed replies, but {env.name} has no tool service")
        self.public = public_key(env.service_key) if self.served else None
        self.pending = list(ep.tools)
        self.ended = ep.finish == "done"  # the worker says the environment ended it
        self.results: list[Any] = []  # the verified results, in order
        self.signed = False  # the newest reply was a signed one

    def respond(self, turns: Sequence[str]) -> str | None:
        """The reply after the newest of `turns`: signed, or the environment's."""
        query = self.env.tool_query(self.task, turns) if self.served else None
        self.signed = query is not None
        if query is None:
            return self.env.respond(self.task, list(turns))
        if not self.pending:
            raise ToolRejected(f"no signed reply for turn {len(turns)}")
        reply = self.pending.pop(0)
        if (reply.call.turn, reply.call.query) != (len(turns), query):
            raise ToolRejected(f"the reply for turn {len(turns)} answers another turn or query")
        try:
            reply.verify(self.public)
        except ReplyRejected as e:
            raise ToolRejected(str(e)) from None
        self.results.append(reply.result)
        return self.env.tool_reply(self.task, turns, reply.result)

    def finish(self, turns: Sequence[str], shown: int) -> None:
        """After the replay of `shown` replies: no signed reply left over, and
        no served turn left unanswered where the episode says the environment
        ended it (a reply dropped)."""
        if self.pending:
            raise ToolRejected(f"{len(self.pending)} signed replies past the episode's turns")
        last = shown < len(turns) and self.served and self.ended
        if last and self.env.tool_query(self.task, turns) is not None:
            raise ToolRejected(f"turn {len(turns)} asks the service, but no reply follows it")
