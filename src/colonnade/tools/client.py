"""A worker's side of a tool service: one call, a timeout per try, bounded retries.

`ToolClient.call` posts a `Call` to the service (`POST {url}/v1/call`) and
returns its `Reply` once it is the answer to that very call and (with the
pinned key) signed by it. A service that is down, slow or answering 5xx is
tried again after a backoff that doubles, a bounded number of times; then
`ToolFailed` says why, and the caller ends that one episode (rollout's
responder): a tool that keeps failing never stops a batch or a worker. A
refusal (4xx) or a reply that does not verify is not retried: asking again
would get the same.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from colonnade.untrusted import SchemaError

from .signed import MAX_RESULT_BYTES, Call, Reply, ReplyRejected

log = logging.getLogger("colonnade.tools")
MAX_REPLY_BYTES = MAX_RESULT_BYTES + (16 << 10)  # the result, the call and the signature
CALL_PATH = "/v1/call"


class ToolFailed(RuntimeError):
    """The service gave no usable reply; `reason` names why, for the counts."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # unavailable | refused | unverified


@dataclass
class Retry:
    """How long a call may take: `tries` tries of `timeout` seconds each,
    `first_wait` seconds before the second, doubling, at most `max_wait`."""

    tries: int = 6
    timeout: float = 10.0
    first_wait: float = 0.5
    max_wait: float = 8.0

    def __post_init__(self) -> None:
        if self.tries < 1 or self.timeout <= 0 or self.first_wait < 0 or self.max_wait < 0:
            raise ValueError("tries >= 1, timeout > 0 and waits >= 0")

    def wait(self, attempt: int) -> float:
        """Seconds to wait after the `attempt`-th failed try (from 0)."""
        return min(self.max_wait, self.first_wait * 2**attempt)


@dataclass
class ToolClient:
    """Calls to one service; `public`: its pinned key (None: replies unchecked)."""

    url: str
    public: Ed25519PublicKey | None = None
    retry: Retry = field(default_factory=Retry)
    sleep: Callable[[float], None] = time.sleep
    retries: int = 0  # tries that failed and were tried again
    failures: int = 0  # calls that gave up
    # Calls run on several threads at once (a worker's rows wait in parallel).
    _counts: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def call(self, call: Call) -> Reply:
        """The service's verified reply to `call`; ToolFailed once retries run
        out. Safe to call from several threads."""
        for attempt in range(self.retry.tries):
            try:
                return self._checked(call, self._post(call))
            except ToolFailed as e:
                if e.reason != "unavailable" or attempt + 1 == self.retry.tries:
                    with self._counts:
                        self.failures += 1
                    raise
                wait = self.retry.wait(attempt)
                log.warning("tool service %s (try %d of %d): %s; again in %.1f s", self.url,
                            attempt + 1, self.retry.tries, e, wait)  # fmt: skip
                with self._counts:
                    self.retries += 1
                self.sleep(wait)
        raise AssertionError("unreachable")

    def _post(self, call: Call) -> bytes:
        body = json.dumps(call.to_dict()).encode()
        req = urllib.request.Request(
            self.url.rstrip("/") + CALL_PATH,
            data=body,
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(req, timeout=self.retry.timeout) as resp:
                data = resp.read(MAX_REPLY_BYTES + 1)
                if resp.length and len(data) <= MAX_REPLY_BYTES:  # closed before its length
                    raise ToolFailed("unavailable", f"a reply cut short after {len(data)} bytes")
        except urllib.error.HTTPError as e:
            detail = _detail(e)
            if 400 <= e.code < 500 and e.code not in (408, 429):
                raise ToolFailed("refused", f"HTTP {e.code}: {detail}") from None
            raise ToolFailed("unavailable", f"HTTP {e.code}: {detail}") from None
        except (OSError, http.client.HTTPException) as e:  # refused, reset, timed out, cut
            raise ToolFailed("unavailable", str(getattr(e, "reason", e))[:200] or repr(e)) from None
        if len(data) > MAX_REPLY_BYTES:
            raise ToolFailed("refused", f"a reply of more than {MAX_REPLY_BYTES} bytes")
        return data

    def _checked(self, call: Call, data: bytes) -> Reply:
        try:
            reply = Reply.from_dict(json.loads(data))
        except (ValueError, RecursionError) as e:  # SchemaError, JSONDecodeError
            raise ToolFailed("unverified", f"not a reply: {str(e)[:200]}") from None
        if reply.call != call:
            raise ToolFailed("unverified", "the reply answers another call")
        if self.public is not None:
            try:
                reply.verify(self.public)
            except (ReplyRejected, SchemaError) as e:
                raise ToolFailed("unverified", str(e)) from None
        return reply


def _detail(e: urllib.error.HTTPError) -> str:
    try:
        return json.loads(e.read(4096)).get("error", "")[:200]
    except (ValueError, AttributeError, OSError):
        return e.reason if isinstance(e.reason, str) else ""
