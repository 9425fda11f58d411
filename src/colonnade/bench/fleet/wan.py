"""The fleet simulation's store: one shared store seen through a WAN per client.

`bench fleet` gives every simulated worker, the trainer and the joiner its own
`WanStore` around the same inner store. Each view

- counts its requests by verb (the `ObjectStore` method called: `get`,
  `put`, `put_if_absent`, `size`, `list`, `delete`, `put_file`, `get_file`)
  and the payload bytes down and up, under its client's name, in a `Tally`
  shared by all views (reads of `latest.json`, the polls, also on their own);
- delays every request by one round trip (`Link.latency_s`) plus its payload's
  transfer time over the client's own link (`Link.bytes_per_s`): a worker's
  threads (its loop and its background fetch) share one home line, so a
  second transfer queues behind the first.

Reads happen when the request reaches the store and return after the delay;
writes become visible after it (the upload has to arrive first). Billing
classes (R2 class A/B, S3 PUT/GET) are mapped from the verbs in `costs`, not
here.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from colonnade.protocol import keys
from colonnade.store import ObjectStore

VERBS = ("get", "size", "get_file", "list", "put", "put_if_absent", "put_file", "delete")
_ANCHOR_NAME = keys.full_key(0).rsplit("/", 1)[1]


def is_anchor(key: str) -> bool:
    """Whether `key` is a version's full state (`weights/{v}/full.safetensors`)."""
    return keys.parse_weights_key(key) is not None and key.endswith("/" + _ANCHOR_NAME)


class Link:
    """One client's line to the store: a round trip per request, and a
    bandwidth its concurrent transfers share (0: unlimited)."""

    def __init__(self, latency_s: float = 0.0, mbit_per_s: float = 0.0) -> None:
        self.latency_s = latency_s
        self.bytes_per_s = mbit_per_s * 1e6 / 8
        self._busy_until = 0.0
        self._lock = threading.Lock()

    def delay(self, nbytes: int) -> float:
        """Seconds this request takes: the round trip, the wait for the line
        to be free, and the transfer itself."""
        if not self.bytes_per_s or not nbytes:
            return self.latency_s
        now = time.monotonic()
        with self._lock:
            start = max(now, self._busy_until)
            self._busy_until = start + nbytes / self.bytes_per_s
            return self.latency_s + self._busy_until - now

    def wait(self, nbytes: int = 0) -> None:
        seconds = self.delay(nbytes)
        if seconds > 0:
            time.sleep(seconds)


@dataclass
class Tally:
    """Requests, bytes and anchor downloads per client, and rollout uploads
    per version; shared by every view and safe across threads."""

    requests: dict[str, Counter] = field(default_factory=dict)  # client -> verb -> n
    down: Counter = field(default_factory=Counter)  # client -> payload bytes read
    up: Counter = field(default_factory=Counter)  # client -> payload bytes written
    anchors: Counter = field(default_factory=Counter)  # client -> full.safetensors reads
    polls: Counter = field(default_factory=Counter)  # client -> latest.json reads
    uploads: Counter = field(default_factory=Counter)  # version -> rollout batches written
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, client: str, verb: str, down: int = 0, up: int = 0) -> None:
        with self._lock:
            self.requests.setdefault(client, Counter())[verb] += 1
            self.down[client] += down
            self.up[client] += up

    def anchor(self, client: str) -> None:
        with self._lock:
            self.anchors[client] += 1

    def polled(self, client: str) -> None:
        with self._lock:
            self.polls[client] += 1

    def uploaded(self, version: int) -> None:
        with self._lock:
            self.uploads[version] += 1

    def snapshot(self) -> dict:
        """A consistent copy of every counter (per-version figures are differences)."""
        with self._lock:
            return {
                "requests": {c: Counter(n) for c, n in self.requests.items()},
                "down": Counter(self.down),
                "up": Counter(self.up),
                "anchors": Counter(self.anchors),
                "polls": Counter(self.polls),
                "uploads": Counter(self.uploads),
            }

    def total_requests(self, clients=None) -> int:
        with self._lock:
            return sum(
                sum(n.values()) for c, n in self.requests.items() if clients is None or c in clients
            )


class WanStore(ObjectStore):
    """`inner` as client `client` sees it over its `link`, counted in `tally`.

    `on_write(key, data)` is called after each successful put (the bench
    watches the trainer's writes of `weights/latest.json` to close a version).
    """

    def __init__(
        self,
        inner: ObjectStore,
        client: str,
        tally: Tally,
        link: Link,
        on_write: Callable[[str, bytes], None] | None = None,
    ) -> None:
        super().__init__(max_put_bytes=inner.max_put_bytes, multipart_bytes=inner.multipart_bytes)
        self.inner, self.client, self.tally, self.link = inner, client, tally, link
        self.on_write = on_write

    @property
    def url(self) -> str:
        return self.inner.url

    def sub(self, prefix: str) -> WanStore:
        """The inbox folder, over the same link and tally."""
        return WanStore(self.inner.sub(prefix), self.client, self.tally, self.link, self.on_write)

    def _written(self, key: str, data: bytes) -> None:
        parsed = keys.parse_rollout_key(key)
        if parsed is not None:
            self.tally.uploaded(parsed[0])
        if self.on_write is not None:
            self.on_write(key, data)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        try:
            data = self.inner.get(key, max_bytes=max_bytes)
        except Exception:  # a miss costs its round trip too
            self.link.wait()
            self.tally.add(self.client, "get")
            raise
        self.link.wait(len(data))
        self.tally.add(self.client, "get", down=len(data))
        if is_anchor(key):
            self.tally.anchor(self.client)
        elif key == keys.LATEST:
            self.tally.polled(self.client)
        return data

    def put(self, key: str, data: bytes) -> None:
        self.link.wait(len(data))
        self.inner.put(key, data)
        self.tally.add(self.client, "put", up=len(data))
        self._written(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.link.wait(len(data))
        wrote = self.inner.put_if_absent(key, data)
        self.tally.add(self.client, "put_if_absent", up=len(data))
        if wrote:
            self._written(key, data)
        return wrote

    def size(self, key: str) -> int:
        self.link.wait()
        self.tally.add(self.client, "size")
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        self.link.wait()
        self.tally.add(self.client, "list")
        return self.inner.list(prefix)

    def list_times(self, prefix: str = "") -> dict[str, float]:
        self.link.wait()
        self.tally.add(self.client, "list")
        return self.inner.list_times(prefix)

    def delete(self, key: str) -> None:
        self.link.wait()
        self.tally.add(self.client, "delete")
        self.inner.delete(key)

    def delete_many(self, keys_: list[str]) -> None:
        # One request per 1,000 keys, as S3's DeleteObjects (R2 the same).
        for i in range(0, len(keys_), 1000):
            self.link.wait()
            self.tally.add(self.client, "delete")
            self.inner.delete_many(keys_[i : i + 1000])

    def put_file(self, key: str, path: Path) -> None:
        n = Path(path).stat().st_size
        self.link.wait(n)
        self.inner.put_file(key, path)
        self.tally.add(self.client, "put_file", up=n)

    def get_file(self, key: str, path: Path, *, max_bytes: int | None = None) -> int:
        try:
            n = self.inner.get_file(key, path, max_bytes=max_bytes)
        except Exception:
            self.link.wait()
            self.tally.add(self.client, "get_file")
            raise
        self.link.wait(n)
        self.tally.add(self.client, "get_file", down=n)
        if is_anchor(key):
            self.tally.anchor(self.client)
        return n

    def clean_partial(self, prefix: str, before: float) -> int:
        self.link.wait()
        self.tally.add(self.client, "list")
        return self.inner.clean_partial(prefix, before)
