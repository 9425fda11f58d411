"""The HTTP layer: OpenAI's routes under /v1 on the standard library's threaded server.

Routes: GET /v1/models, POST /v1/chat/completions, POST /v1/completions,
GET /health. Each connection has its own thread (HTTP/1.1 keep-alive, so a
client's pool reuses them); a request is read within stated bounds (a
Content-Length, at most `Bounds.max_body_bytes`, JSON nested at most
`untrusted.MAX_JSON_DEPTH` deep), checked (`requests.py`), handed to the
`Batcher` and answered when its episodes end. Every refusal is one JSON
object in OpenAI's error shape with its HTTP status: 400 for a request
the server will not run, 404 for an unknown route or model, 411/413 for
a body without a length or too long, 503 when the engine's queue is full,
504 when the episodes took longer than the server waits.

The standard library's server is enough: the work of a request is the
engine's (one thread, batched), and the HTTP threads only parse, wait and
write; it adds no dependency.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any
from urllib.parse import urlsplit

from colonnade.httpjson import BodyRefused, BoundedServer, JsonHandler

from .batcher import Batcher, Busy
from .requests import Job, RequestError, Served, chat_job, completion_job
from .responses import Pieces, chat_response, completion_response, error_body, models_response

log = logging.getLogger("colonnade.serve")

Route = tuple[Callable[[Any, Any, Served], Job], Callable[..., dict]]
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": (chat_job, chat_response),
    "/v1/completions": (completion_job, completion_response),
}


class Endpoint:
    """The HTTP server over a `Batcher`: `start` serves on a thread of its own."""

    def __init__(self, batcher: Batcher, tokenizer, served: Served, host: str = "127.0.0.1",
                 port: int = 8000, request_timeout: float = 600.0,
                 max_connections: int = 256) -> None:  # fmt: skip
        self.batcher, self.tokenizer, self.served = batcher, tokenizer, served
        self.pieces = Pieces(tokenizer)
        self.request_timeout = request_timeout
        self.created = int(time.time())
        self.httpd = _Server((host, port), _Handler, max_connections)
        self.httpd.endpoint = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        """The base URL an OpenAI client takes (…/v1)."""
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> None:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop taking connections (requests in flight are answered by their threads)."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    def answer(self, path: str, body: Any) -> dict:
        """The response to a POST of `body` to `path`; RequestError, Busy,
        TimeoutError or the engine's error where there is none."""
        make_job, respond = ROUTES[path]
        job = make_job(body, self.tokenizer, self.served)
        prompts = [p for p in job.prompts for _ in range(job.n)]
        future = self.batcher.submit(prompts, job.keys(), job.limits, job.origin)
        try:
            episodes = future.result(timeout=self.request_timeout)
        except FutureTimeout:
            raise TimeoutError(f"no answer within {self.request_timeout:g} s") from None
        if job.episode is not None:  # a worker's episode goes on with this turn
            text = self.pieces.text(episodes[0], job.stop)
            self.served.episodes.record(job.episode, job.prompts[0], episodes[0], text)
        return respond(job, episodes, self.served, self.pieces)


class _Server(BoundedServer):
    endpoint: Endpoint


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    server_version = "colonnade"
    timeout = 120  # seconds a connection may sit idle or send slowly
    server: _Server

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        path = urlsplit(self.path).path
        endpoint = self.server.endpoint
        if path == "/v1/models":
            self.send_json(200, models_response(endpoint.served, endpoint.created))
        elif path == "/health":
            self.send_json(200, {"status": "ok"})
        else:
            self.send_json(404, error_body(f"no route GET {path}", "not_found_error"))

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        try:
            if path not in ROUTES:
                raise RequestError(f"no route POST {path}", None, 404, "not_found_error")
            body = self._body()
            self.send_json(200, self.server.endpoint.answer(path, body))
        except RequestError as e:
            self.send_json(e.status, error_body(str(e), e.kind, e.param, e.code))
        except Busy as e:
            self.send_json(503, error_body(str(e), "overloaded_error"))
        except TimeoutError as e:
            self.send_json(504, error_body(str(e), "timeout_error"))
        except Exception as e:
            log.exception("POST %s failed", path)
            self.send_json(
                500, error_body(f"the engine failed: {type(e).__name__}", "server_error")
            )

    def _body(self) -> Any:
        """The request's JSON, read within the bounds."""
        try:
            return self.read_json(self.server.endpoint.served.bounds.max_body_bytes)
        except BodyRefused as e:
            raise RequestError(str(e), None, e.status) from None
        except ValueError as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise RequestError(f"the body is not JSON the server reads: {e}") from None
