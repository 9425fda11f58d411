"""JSON over HTTP for colonnade's small servers (the OpenAI-compatible
endpoint, tool services): a request's body read within a bound before any
of it is parsed, and an answer written whole, with its length.

A body without a Content-Length (chunked, or none) is refused rather than
read to its end, and so is one declared longer than the bound: the server
then closes the connection, the body unread. `BoundedServer` holds at most
so many connections, each on a thread of its own.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from .untrusted import check_json


class BodyRefused(Exception):
    """A request body the server will not read; `status`: 411 or 413."""

    def __init__(self, status: int, text: str):
        super().__init__(text)
        self.status = status


class JsonHandler(BaseHTTPRequestHandler):
    """A request handler whose bodies and answers are JSON."""

    def read_json(self, limit: int) -> Any:
        """The request's JSON, of at most `limit` bytes: BodyRefused for a
        body it will not read, ValueError for one that is not bounded JSON
        (`untrusted.check_json`)."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding") or length is None:
            self.close_connection = True
            raise BodyRefused(411, "send the body with a Content-Length")
        if not length.isdigit() or int(length) > limit:
            self.close_connection = True  # the body is left unread
            raise BodyRefused(413, f"the body must be at most {limit} bytes")
        data = self.rfile.read(int(length))
        check_json(data, limit)
        return json.loads(data)

    def send_json(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            if self.close_connection:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left: its answer goes nowhere


class BoundedServer(ThreadingHTTPServer):
    """A threaded HTTP server of at most `max_connections` connections: one
    past the bound is closed at once (its thread would not be free)."""

    daemon_threads = True
    # The listen backlog: the standard library's 5 resets clients that
    # connect together (a worker opens one per episode, or per tool call).
    request_queue_size = 1024

    def __init__(self, address, handler, max_connections: int) -> None:
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()
