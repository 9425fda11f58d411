"""Metric rows in the store, as append-only segments of JSON lines:
`metrics/{role}-{id}/{segment:06d}.jsonl`, at most `SEGMENT_ROWS` rows each.

Object stores cannot append, so the open segment is rewritten on each flush
(rate-limited); once full it is never written again and the next one opens.
A flush costs one small PUT however long the run, and a process holds one
segment's rows. A restarted process with the same role and id continues its
last segment, so history survives a crash up to the last flush.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from colonnade.protocol import keys
from colonnade.store import NotFound, ObjectStore, StoreError

log = logging.getLogger("colonnade.telemetry")
MAX_METRICS_BYTES = 64 << 20
PREFIX = "metrics/"
SEGMENT_ROWS = 500


def segment_key(role: str, ident: str, segment: int) -> str:
    return f"{PREFIX}{role}-{keys.check_worker_id(ident)}/{segment:06d}.jsonl"


def parse_rows(data: bytes) -> list[dict]:
    """The rows of a metrics file; lines that are not JSON objects are skipped."""
    rows = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class Telemetry:
    """Rows of one process; `exporter` (optional) mirrors them to Prometheus."""

    def __init__(
        self,
        store: ObjectStore,
        role: str,
        ident: str,
        flush_seconds: float = 5.0,
        exporter: Any = None,
    ):
        self.store, self.role, self.ident = store, role, ident
        self.flush_seconds = flush_seconds
        self.exporter = exporter
        self.segment = 0
        self.rows: list[dict] = []  # of the open segment
        done = sorted(store.list(segment_key(role, ident, 0).rsplit("/", 1)[0] + "/"))
        if done:
            self.segment = int(done[-1].rsplit("/", 1)[1].split(".")[0])
            with contextlib.suppress(NotFound):
                self.rows = parse_rows(store.get(done[-1], max_bytes=MAX_METRICS_BYTES))
        self.last: dict | None = self.rows[-1] if self.rows else None
        self._flushed = time.monotonic()
        self._dirty = False

    def row(self, **fields: Any) -> dict:
        fields.setdefault("time", time.time())
        self.rows.append(fields)
        self.last = fields
        self._dirty = True
        if self.exporter is not None:
            self.exporter.observe(self.role, fields)
        full = len(self.rows) >= SEGMENT_ROWS
        if full or time.monotonic() - self._flushed >= self.flush_seconds:
            self.flush()
        return fields

    def flush(self) -> None:
        """Write the open segment; a store error is logged and retried at the next flush."""
        if not self._dirty:
            return
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.rows)
        try:
            self.store.put(segment_key(self.role, self.ident, self.segment), data.encode())
        except StoreError as e:
            log.warning("metrics not written (%s); will retry", e)
            return
        self._flushed = time.monotonic()
        self._dirty = False
        if len(self.rows) >= SEGMENT_ROWS:  # full and written: it is final
            self.segment += 1
            self.rows = []


def read_rows(store: ObjectStore, role: str | None = None) -> dict[str, list[dict]]:
    """{"{role}-{id}": rows} of every process (of `role`, when given), its
    segments in order (and a whole-file `metrics/{role}-{id}.jsonl` of
    earlier releases, first)."""
    parts: dict[str, list[str]] = {}
    for key in store.list(PREFIX):
        rest = key[len(PREFIX) :]
        name = rest.split("/", 1)[0].removesuffix(".jsonl")
        if not key.endswith(".jsonl") or (role and not name.startswith(f"{role}-")):
            continue
        parts.setdefault(name, []).append(key)
    out = {}
    for name, segment_keys in parts.items():
        rows: list[dict] = []
        for key in sorted(segment_keys, key=lambda k: (k.count("/"), k)):
            with contextlib.suppress(NotFound):
                rows += parse_rows(store.get(key, max_bytes=MAX_METRICS_BYTES))
        out[name] = rows
    return out
