"""Requests from many threads into one running batch: the engine's streaming source.

The HTTP threads `submit` a request's episodes and wait on a future; one
thread runs `Engine.run` over the `Inbox` (`Batcher.serve`), which hands
the episodes waiting to the engine before every step, as many as there are
free rows: a request that arrives while others run joins the running batch
at the next step (continuous batching), and one episode runs exactly as the
same row would in `Engine.generate` with the same draw key.

The engine runs on the thread that calls `serve` (MLX keeps its streams
per thread: that is the thread that built the engine). An error out of the
engine fails the requests it held, and those waiting, and the loop goes
on with the next; `close` lets the running episodes end, then returns.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from colonnade.engine import Engine, Episode, SamplingParams
from colonnade.engine.loop import Admission

log = logging.getLogger("colonnade.serve")


class Busy(RuntimeError):
    """More episodes are waiting than the server queues: try again later."""


class _Request:
    """One request's episodes: its future is set once the last one ends."""

    def __init__(self, count: int) -> None:
        self.future: Future[list[Episode]] = Future()
        self.episodes: list[Episode | None] = [None] * count
        self.left = count

    def finished(self, i: int, episode: Episode) -> bool:
        """Record episode i (on the engine's thread); True when it was the last."""
        self.episodes[i] = episode
        self.left -= 1
        return self.left == 0


class Inbox:
    """The episodes waiting for a row, in arrival order (`engine.loop.Source`)."""

    def __init__(self, max_waiting: int) -> None:
        self.max_waiting = max_waiting
        self._waiting: deque[Admission] = deque()
        self._cond = threading.Condition()
        self._closed = False

    def put(self, episodes: Sequence[Admission]) -> None:
        with self._cond:
            if self._closed:
                raise Busy("the server is shutting down")
            if len(self._waiting) + len(episodes) > self.max_waiting:
                raise Busy(f"{len(self._waiting)} episodes are waiting for the engine")
            self._waiting.extend(episodes)
            self._cond.notify()

    def admit(self, room: int | None, idle: bool) -> list[Admission]:
        with self._cond:
            while idle and not self._waiting and not self._closed:
                self._cond.wait()
            take = len(self._waiting) if room is None else min(room, len(self._waiting))
            return [self._waiting.popleft() for _ in range(take)]

    def upcoming(self) -> set[tuple[int, ...]]:
        with self._cond:
            return {tuple(a.prompt) for a in self._waiting}

    def drain(self) -> list[Admission]:
        """Everything waiting, taken out."""
        with self._cond:
            out = list(self._waiting)
            self._waiting.clear()
            return out

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed


class Batcher:
    """One engine serving requests from any thread.

    `params`: the distribution every episode is sampled from (the server's);
    `max_rows`: episodes running at once (0: no bound); `max_waiting`:
    episodes queued for a row beyond those, past which `submit` refuses.
    """

    def __init__(self, engine: Engine, params: SamplingParams, max_rows: int = 32,
                 max_waiting: int = 1024) -> None:  # fmt: skip
        self.engine, self.params, self.max_rows = engine, params, max_rows
        self.inbox = Inbox(max_waiting)
        self._open: set[_Request] = set()  # submitted, not finished
        self._lock = threading.Lock()

    def submit(
        self,
        prompts: Sequence[Sequence[int]],
        keys: Sequence[bytes],
        limits: SamplingParams,
        origin: int = 0,
    ) -> Future[list[Episode]]:
        """Run one episode per prompt (one turn, within `limits`, its draws
        from position `origin` on); the future holds them in order. Busy when
        the queue is full."""
        request = _Request(len(prompts))
        episodes = [
            Admission(p, _one_turn, k, limits, self._finisher(request, i), origin)
            for i, (p, k) in enumerate(zip(prompts, keys, strict=True))
        ]
        with self._lock:
            self._open.add(request)
        try:
            self.inbox.put(episodes)
        except Busy:
            with self._lock:
                self._open.discard(request)
            raise
        return request.future

    def _finisher(self, request: _Request, i: int):
        def done(episode: Episode) -> None:
            if request.finished(i, episode):
                with self._lock:
                    self._open.discard(request)
                # (Failed already where the engine failed while it was queued.)
                if not request.future.done():
                    request.future.set_result(list(request.episodes))

        return done

    def serve(self) -> None:
        """Run the engine on this thread until `close`."""
        while not self.inbox.closed:
            try:
                self.engine.run(self.inbox, self.params, self.max_rows)
            except Exception as e:
                log.exception("the engine failed; failing the requests it held")
                self._fail_all(e)

    def _fail_all(self, error: Exception) -> None:
        self.inbox.drain()
        with self._lock:
            failed, self._open = self._open, set()
        for request in failed:
            request.future.set_exception(error)

    def close(self) -> None:
        """No more requests; `serve` returns once the running episodes end."""
        self.inbox.close()


def _one_turn(_text: str) -> None:
    """The endpoint's responder: a completion is one model turn."""
    return None
