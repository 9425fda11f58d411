"""An OpenAI-compatible endpoint over the rollout engine (`colonnade serve`).

The parts, each unaware of the others but through what is passed in:

- `requests.py`: a request body (untrusted JSON) checked into a `Job`: the
  prompt tokens, `n`, per-request limits and draw keys, what to report;
- `batcher.py`: the engine's streaming source (`Inbox`) and the thread that
  runs the engine over it (`Batcher.serve`): requests from any thread join
  one running batch as rows free up (continuous batching);
- `responses.py`: episodes into OpenAI's response shapes, with vLLM's token
  ids and per-token log-probs;
- `http.py`: the routes under /v1 on the standard library's threaded server.

`Server` wires them: one engine, one sampling distribution (the server's;
see `requests.py`), one model name. docs/serving.md describes the endpoint
from the outside.
"""

from __future__ import annotations

import threading

from colonnade.engine import Engine

from .batcher import Batcher, Busy
from .http import Endpoint
from .requests import Bounds, Job, RequestError, Served

__all__ = ["Batcher", "Bounds", "Busy", "Endpoint", "Job", "RequestError", "Served", "Server"]


class Server:
    """The endpoint over `engine`: `serve` on the thread that built the engine
    (the CLI), or `start` on a thread of its own (tests, benchmarks)."""

    def __init__(self, engine: Engine, served: Served, max_rows: int = 32, host: str = "127.0.0.1",
                 port: int = 8000, max_waiting: int = 1024,
                 request_timeout: float = 600.0) -> None:  # fmt: skip
        self.batcher = Batcher(engine, served.sampling, max_rows, max_waiting)
        self.endpoint = Endpoint(self.batcher, engine.tokenizer, served, host, port,
                                 request_timeout)  # fmt: skip
        self._engine_thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return self.endpoint.url

    def serve(self) -> None:
        """Answer requests until `close` (from another thread) or Ctrl-C."""
        self.endpoint.start()
        try:
            self.batcher.serve()
        finally:
            self.endpoint.close()

    def start(self) -> Server:
        self.endpoint.start()
        self._engine_thread = threading.Thread(target=self.batcher.serve, name="engine",
                                               daemon=True)  # fmt: skip
        self._engine_thread.start()
        return self

    def close(self) -> None:
        self.batcher.close()
        if self._engine_thread is not None:
            self._engine_thread.join()
            self.endpoint.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()
