"""Metric rows in the store, as append-only segments of JSON lines:
`metrics/{role}-{id}/{segment:06d}.jsonl`, at most `SEGMENT_ROWS` rows each.

Object stores cannot append, so the open segment is rewritten on each flush
(rate-limited); once full it is never written again and the next one opens.
A flush costs one small PUT however long the run, and a process holds one
segment's rows. A restarted process with the same role and id continues its
last segment, so history survives a crash up to the last flush.

What a row holds is declared in `protocol.metrics` (`TrainerRow`,
`WorkerRow`): writers pass a typed row to `Telemetry.write`, readers take
typed rows from `read_trainer_rows` / `read_worker_rows`. `read_rows` is the
raw JSON underneath, for tests and audits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import Any

from colonnade.protocol import keys
from colonnade.protocol.metrics import TrainerRow, WorkerRow
from colonnade.protocol.metrics import parse_rows as typed_rows
from colonnade.store import NotFound, ObjectStore, StoreError

log = logging.getLogger("colonnade.telemetry")
MAX_METRICS_BYTES = 64 << 20
SEGMENT_ROWS = 500
TRAINER = "trainer-main"  # the trainer's {role}-{id}
segment_key = keys.metrics_key


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
        done = sorted(
            (parsed[2], k)
            for k in store.list(keys.metrics_dir(role, ident))
            if (parsed := keys.parse_metrics_key(k)) is not None and parsed[2] >= 0
        )
        if done:
            self.segment, last_key = done[-1]
            with contextlib.suppress(NotFound):
                self.rows = parse_rows(store.get(last_key, max_bytes=MAX_METRICS_BYTES))
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

    def write(self, row: TrainerRow | WorkerRow) -> dict:
        """Record a typed row (`protocol.metrics`): what the trainer and workers write."""
        return self.row(**row.to_dict())

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
    parts: dict[str, list[tuple[int, str]]] = {}
    for key in store.list(keys.METRICS):
        parsed = keys.parse_metrics_key(key)
        if parsed is None or (role and parsed[0] != role):
            continue
        parts.setdefault(f"{parsed[0]}-{parsed[1]}", []).append((parsed[2], key))
    out = {}
    for name, segment_keys in parts.items():
        rows: list[dict] = []
        for _, key in sorted(segment_keys):  # the whole file of earlier releases is -1: first
            with contextlib.suppress(NotFound):
                rows += parse_rows(store.get(key, max_bytes=MAX_METRICS_BYTES))
        out[name] = rows
    return out


def read_trainer_rows(store: ObjectStore) -> list[TrainerRow]:
    """The trainer's rows, in order; rows that fail their type are skipped."""
    return typed_rows(TrainerRow, read_rows(store, "trainer").get(TRAINER, []))


def read_worker_rows(store: ObjectStore) -> dict[str, list[WorkerRow]]:
    """{worker id: its rows, in order}; rows that fail their type are skipped."""
    return {
        name.removeprefix("worker-"): typed_rows(WorkerRow, rows)
        for name, rows in read_rows(store, "worker").items()
    }
