"""A store that counts its requests by verb: what a role costs the store.

Wraps any ObjectStore; every call is passed on and counted under its verb
(`get`, `put`, `put_if_absent`, `size` for exists/size, `list`, `delete`,
`put_file`, `get_file`). Benchmarks and tests read `counts` to measure
requests per worker per version.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from .base import ObjectStore


class Counting(ObjectStore):
    def __init__(self, inner: ObjectStore) -> None:
        super().__init__(max_put_bytes=inner.max_put_bytes, multipart_bytes=inner.multipart_bytes)
        self.inner = inner
        self.counts: Counter = Counter()

    @property
    def url(self) -> str:
        return self.inner.url

    def sub(self, prefix: str) -> Counting:
        """Counted under the same `counts`: one role's requests, both stores."""
        out = Counting(self.inner.sub(prefix))
        out.counts = self.counts
        return out

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        self.counts["get"] += 1
        return self.inner.get(key, max_bytes=max_bytes)

    def put(self, key: str, data: bytes) -> None:
        self.counts["put"] += 1
        self.inner.put(key, data)

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self.counts["put_if_absent"] += 1
        return self.inner.put_if_absent(key, data)

    def size(self, key: str) -> int:
        self.counts["size"] += 1
        return self.inner.size(key)

    def list(self, prefix: str = "") -> list[str]:
        self.counts["list"] += 1
        return self.inner.list(prefix)

    def list_times(self, prefix: str = "") -> dict[str, float]:
        self.counts["list"] += 1
        return self.inner.list_times(prefix)

    def delete(self, key: str) -> None:
        self.counts["delete"] += 1
        self.inner.delete(key)

    def put_file(self, key: str, path: Path) -> None:
        self.counts["put_file"] += 1
        self.inner.put_file(key, path)

    def get_file(self, key: str, path: Path, *, max_bytes: int | None = None) -> int:
        self.counts["get_file"] += 1
        return self.inner.get_file(key, path, max_bytes=max_bytes)

    def clean_partial(self, prefix: str, before: float) -> int:
        self.counts["list"] += 1
        return self.inner.clean_partial(prefix, before)
