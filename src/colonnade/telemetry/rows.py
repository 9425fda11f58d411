"""Metric rows in the store: `metrics/{role}-{id}.jsonl`, one JSON object a line.

Object stores cannot append, so the whole file is rewritten on each flush;
flushes are rate-limited and a process keeps its rows in memory (a run of
thousands of versions is a few hundred KB). A restarted process with the
same role and id reads its old rows first, so history survives a crash up to
the last flush.
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


def metrics_file(role: str, ident: str) -> str:
    return f"{PREFIX}{role}-{keys.check_worker_id(ident)}.jsonl"


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
        self.store = store
        self.key = metrics_file(role, ident)
        self.role = role
        self.flush_seconds = flush_seconds
        self.exporter = exporter
        self.rows: list[dict] = []
        with contextlib.suppress(NotFound):
            self.rows = parse_rows(store.get(self.key, max_bytes=MAX_METRICS_BYTES))
        self._flushed = time.monotonic()
        self._dirty = False

    def row(self, **fields: Any) -> dict:
        fields.setdefault("time", time.time())
        self.rows.append(fields)
        self._dirty = True
        if self.exporter is not None:
            self.exporter.observe(self.role, fields)
        if time.monotonic() - self._flushed >= self.flush_seconds:
            self.flush()
        return fields

    def flush(self) -> None:
        """Write every row; a store error is logged and retried at the next flush."""
        if not self._dirty:
            return
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.rows)
        try:
            self.store.put(self.key, data.encode())
        except StoreError as e:
            log.warning("metrics not written (%s); will retry", e)
            return
        self._flushed = time.monotonic()
        self._dirty = False


def read_rows(store: ObjectStore, role: str | None = None) -> dict[str, list[dict]]:
    """{"{role}-{id}": rows} for every metrics file (of `role`, when given)."""
    out = {}
    for key in store.list(PREFIX):
        name = key[len(PREFIX) :]
        if not name.endswith(".jsonl") or (role and not name.startswith(f"{role}-")):
            continue
        out[name[: -len(".jsonl")]] = parse_rows(store.get(key, max_bytes=MAX_METRICS_BYTES))
    return out
