"""An environment with a tool service: what it has, and one episode's calls.

An environment is *served* when it names a `service` (a URL; "" or absent:
it answers every reply itself, as every environment did before). It then
has, beside the `Environment` members:

- `service_key` (str): the hex public key that signs the service's
  replies; it travels with the environment's arguments, inside the
  trainer-signed run.json, so every side pins the same one;
- `tool_query(task, turns) -> str | None`: pure: the query the newest turn
  asks the service, or None: the reply is `respond(task, turns)`'s, as for
  any environment (for searchqa that is the end of the episode);
- `tool_reply(task, turns, result) -> str`: pure: the text appended after
  the turn, from the service's result;
- `tool_result(query)`: the answer itself (run where the data is: by
  `colonnade tools serve`, on the environment built without a service);
- `score(task, turns, results=None)`: `results` are the service's results
  of the episode's served replies, in order (the trainer passes the
  verified ones, so scoring needs no call).

`EpisodeTools` is one episode's calls on a worker: each served turn is
asked with the episode's row and turn (tools/signed.py), and a tool that
keeps failing ends that episode alone (`failed` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Executor, Future
from typing import Any, Protocol, runtime_checkable

from .client import Retry, ToolClient, ToolFailed
from .signed import Call, Reply, public_key

log = logging.getLogger("colonnade.tools")
# The environment arguments that say where its service is, not what it answers.
ADDRESS_ARGS = ("service", "service_key")


@runtime_checkable
class Served(Protocol):
    service: str
    service_key: str

    def tool_query(self, task, turns: Sequence[str]) -> str | None: ...

    def tool_reply(self, task, turns: Sequence[str], result: Any) -> str: ...

    def tool_result(self, query: str) -> Any: ...


def served(env: Any) -> bool:
    """Whether `env` has its tool answered by a service."""
    return bool(getattr(env, "service", "")) and isinstance(env, Served)


def client_for(env: Served, retry: Retry | None = None) -> ToolClient:
    """A client of `env`'s service that takes only replies signed by its pinned key."""
    return ToolClient(env.service, public_key(env.service_key), retry or Retry())


def score(env: Any, task, turns: Sequence[str], results: Sequence[Any] | None):
    """`env.score`, given the service's results when the environment is served."""
    if served(env):
        return env.score(task, turns, results=list(results or ()))
    return env.score(task, turns)


class EpisodeTools:
    """One episode's replies on a worker: served turns asked of the service
    with the episode's place in the run, the others answered by `env`.

    With a `pool`, a served turn's reply is a Future run on it: the engine
    parks the row while the call is out (engine/loop.py)."""

    def __init__(self, env: Served, task, client: ToolClient, run: str, row: str,
                 pool: Executor | None = None) -> None:  # fmt: skip
        self.env, self.task, self.client = env, task, client
        self.run, self.row, self.pool = run, row, pool
        self.replies: list[Reply] = []  # the signed replies, one per served turn
        self.failed = ""  # why the tool gave no reply ("": it always did)

    def respond(self, turns: Sequence[str]) -> str | Future[str | None] | None:
        query = self.env.tool_query(self.task, turns)
        if query is None:
            return self.env.respond(self.task, list(turns))
        call = Call(self.run, self.task.id, self.row, len(turns), query)
        if self.pool is None:
            return self._asked(call, list(turns))
        return self.pool.submit(self._asked, call, list(turns))

    def _asked(self, call: Call, turns: list[str]) -> str | None:
        try:
            reply = self.client.call(call)
        except ToolFailed as e:
            log.warning("tool call for %s turn %d failed, episode ended: %s", self.task.id,
                        call.turn, e)  # fmt: skip
            self.failed = e.reason
            return None
        self.replies.append(reply)
        return self.env.tool_reply(self.task, turns, reply.result)

    @property
    def results(self) -> list[Any]:
        return [r.result for r in self.replies]
