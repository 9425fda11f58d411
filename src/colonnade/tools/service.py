"""A tool service: an `answer(query)` callable behind HTTP, every reply signed.

Routes (the contract any service can follow; docs/environments.md):

- `POST /v1/call`: a `Call` as JSON (`run`, `task`, `row`, `turn`,
  `query`); 200 with the `Reply` (`call`, `result`, `signature`), the
  signature over the call and the result (tools/signed.py);
- `GET /v1/key`: `{"public_key": hex}`, the key a run pins;
- `GET /health`: `{"status": "ok", "calls": n}`.

Refusals are `{"error": text}` with 400 (not a call), 411/413 (no length,
too long) or 500 (the tool failed; a client tries again). The same call is
answered with the same reply while the service runs (a bounded memo), so a
worker that asks twice cannot choose between two answers of a tool that is
not deterministic. The service signs any call: whether the call belongs to
the run is for the trainer to check.

The standard library's threaded server, as `colonnade serve` uses: each
connection has a thread; the tool itself must be safe to call from several.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import blake3
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.httpjson import BodyRefused, BoundedServer, JsonHandler
from colonnade.untrusted import SchemaError

from .signed import Call, Reply, key_hex, sign_reply

log = logging.getLogger("colonnade.tools")
MAX_BODY_BYTES = 16 << 10  # a call: its query is at most 4,096 characters
MEMO = 65_536  # calls whose replies are remembered
# Connections served at once: a worker has up to 64 calls out
# (rollout/episodes.py), and a fleet shares the service.
MAX_CONNECTIONS = 512


@dataclass(frozen=True)
class Latency:
    """A slow service, rehearsed: every call waits `median_s` before its
    reply, a `tail_share` of them `tail_s` instead. The call's hash picks
    the slow ones, so a call asked again waits alike."""

    median_s: float = 0.0
    tail_s: float = 0.0
    tail_share: float = 0.0

    def __post_init__(self) -> None:
        if min(self.median_s, self.tail_s) < 0 or not 0 <= self.tail_share <= 1:
            raise ValueError("latencies >= 0 and a tail share within [0, 1]")

    def of(self, call: Call) -> float:
        """Seconds `call` waits."""
        if self.tail_share:
            digest = blake3.blake3(json.dumps(call.to_dict(), sort_keys=True).encode()).digest()
            if int.from_bytes(digest[:8], "big") < self.tail_share * 2**64:
                return self.tail_s
        return self.median_s


class ToolService:
    """The HTTP server over `answer`; `start` serves on a thread of its own.
    `latency`: a rehearsal's wait before each reply (none by default)."""

    def __init__(self, answer: Callable[[str], Any], private: Ed25519PrivateKey,
                 host: str = "127.0.0.1", port: int = 0,
                 latency: Latency | None = None) -> None:  # fmt: skip
        self.answer = answer
        self.private = private
        self.latency = latency
        self.calls = 0
        self._memo: OrderedDict[Call, Reply] = OrderedDict()
        self._lock = threading.Lock()
        self.httpd = _Server((host, port), _Handler, MAX_CONNECTIONS)
        self.httpd.service = self
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def public_hex(self) -> str:
        return key_hex(self.private.public_key())

    def start(self) -> ToolService:
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="tools", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
        self.httpd.server_close()

    def reply(self, call: Call) -> Reply:
        """The signed reply to `call`: the remembered one if it was asked before."""
        if self.latency is not None:
            time.sleep(self.latency.of(call))
        with self._lock:
            self.calls += 1
            if (known := self._memo.get(call)) is not None:
                self._memo.move_to_end(call)
                return known
        made = sign_reply(self.private, call, self.answer(call.query))
        with self._lock:
            made = self._memo.setdefault(call, made)  # two threads raced: the first stands
            while len(self._memo) > MEMO:
                self._memo.popitem(last=False)
        return made


class _Server(BoundedServer):
    service: ToolService


class _Handler(JsonHandler):
    protocol_version = "HTTP/1.1"
    server_version = "colonnade-tools"
    timeout = 60  # seconds a connection may sit idle or send slowly
    server: _Server

    def log_message(self, format: str, *args) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def do_GET(self) -> None:
        path, service = urlsplit(self.path).path, self.server.service
        if path == "/v1/key":
            self.send_json(200, {"public_key": service.public_hex})
        elif path == "/health":
            self.send_json(200, {"status": "ok", "calls": service.calls})
        else:
            self.send_json(404, {"error": f"no route GET {path}"})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        if path != "/v1/call":
            self.send_json(404, {"error": f"no route POST {path}"})
            return
        try:
            call = Call.from_dict(self.read_json(MAX_BODY_BYTES))
        except BodyRefused as e:
            self.send_json(e.status, {"error": str(e)})
            return
        except (SchemaError, ValueError) as e:
            self.send_json(400, {"error": f"not a call: {str(e)[:200]}"})
            return
        try:
            self.send_json(200, self.server.service.reply(call).to_dict())
        except SchemaError as e:  # the tool's result is out of bounds
            log.warning("a result out of bounds for %r: %s", call.query[:80], e)
            self.send_json(500, {"error": f"the tool's result: {str(e)[:200]}"})
        except Exception as e:  # the tool's own failure: the client may try again
            log.exception("the tool failed on %r", call.query[:80])
            self.send_json(500, {"error": f"the tool failed: {type(e).__name__}"})
