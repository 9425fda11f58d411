"""Metric rows in the store, as append-only segments of JSON lines, at most
`SEGMENT_ROWS` rows each: the trainer's under `metrics/trainer-main/` in the
run's store (signed, like everything it writes), each worker's under
`{worker}/metrics/` in the inbox.

Object stores cannot append, so the open segment is rewritten on each flush
(rate-limited); once full it is never written again and the next one opens.
A flush costs one small PUT however long the run, and a process holds one
segment's rows. A restarted process continues its last segment, so history
survives a crash up to the last flush; the trainer continues only a segment
that verifies as its own (another is left as it is and a new one opens).

What a row holds is declared in `protocol.metrics` (`TrainerRow`,
`WorkerRow`): writers pass a typed row to `Telemetry.write`, readers take
typed rows from `read_trainer_rows` / `read_worker_rows`. `trainer_rows` and
`worker_rows` are the raw JSON underneath, for tests and audits.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from colonnade.protocol import keys
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.metrics import TrainerRow, WorkerRow
from colonnade.protocol.metrics import parse_rows as typed_rows
from colonnade.protocol.schemas import SchemaError
from colonnade.protocol.signing import Signer, Trust
from colonnade.store import NotFound, ObjectStore, StoreError

log = logging.getLogger("colonnade.telemetry")
MAX_METRICS_BYTES = 64 << 20
MAX_LINE_BYTES = 1 << 20  # a longer line is not a row of ours
SEGMENT_ROWS = 500


def parse_rows(data: bytes) -> list[dict]:
    """The rows of a metrics file; lines that are not JSON objects, too long
    or nested too deeply, are skipped."""
    rows = []
    for line in data.decode("utf-8", "replace").splitlines():
        if len(line) > MAX_LINE_BYTES:
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


class Telemetry:
    """Rows of one process; `exporter` (optional) mirrors them to Prometheus.
    Built with `for_trainer` or `for_worker`."""

    def __init__(
        self,
        store: ObjectStore,
        role: str,
        segment_key: Callable[[int], str],
        segments: list[tuple[int, str]],
        flush_seconds: float = 5.0,
        exporter: Any = None,
        signer: Signer | None = None,
    ):
        self.store, self.role, self.segment_key = store, role, segment_key
        self.flush_seconds, self.exporter, self.signer = flush_seconds, exporter, signer
        self.segment = 0
        self.rows: list[dict] = []  # of the open segment
        if segments:
            self.segment, last_key = max(segments)
            try:
                self.rows = parse_rows(
                    self._open(last_key, store.get(last_key, max_bytes=MAX_METRICS_BYTES))
                )
            except NotFound:
                pass
            except (SchemaError, StoreError) as e:
                log.warning("%s is not ours (%s): left as it is, a new segment opens", last_key, e)
                self.segment += 1
        self.last: dict | None = self.rows[-1] if self.rows else None
        self._flushed = time.monotonic()
        self._dirty = False

    @classmethod
    def for_trainer(
        cls, store: ObjectStore, signer: Signer, flush_seconds: float = 0.0, exporter: Any = None
    ) -> Telemetry:
        return cls(
            store,
            "trainer",
            keys.trainer_segment_key,
            _trainer_segments(store),
            flush_seconds,
            exporter,
            signer,
        )

    @classmethod
    def for_worker(
        cls, inbox: ObjectStore, worker: str, flush_seconds: float = 10.0, exporter: Any = None
    ) -> Telemetry:
        found = list_inbox(inbox).segments.get(worker, [])
        return cls(
            inbox,
            "worker",
            lambda n: keys.worker_segment_key(worker, n),
            found,
            flush_seconds,
            exporter,
        )

    def _open(self, key: str, data: bytes) -> bytes:
        return self.signer.trust.open_bytes(key, data) if self.signer is not None else data

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
        key = self.segment_key(self.segment)
        data = "".join(json.dumps(r, separators=(",", ":")) + "\n" for r in self.rows).encode()
        if self.signer is not None:
            data = self.signer.seal_bytes(key, data)
        try:
            self.store.put(key, data)
        except StoreError as e:
            log.warning("metrics not written (%s); will retry", e)
            return
        self._flushed = time.monotonic()
        self._dirty = False
        if len(self.rows) >= SEGMENT_ROWS:  # full and written: it is final
            self.segment += 1
            self.rows = []


def _trainer_segments(store: ObjectStore) -> list[tuple[int, str]]:
    return sorted(
        (n, k)
        for k in store.list(keys.TRAINER_METRICS)
        if (n := keys.parse_trainer_segment(k)) is not None
    )


def _segment_rows(store: ObjectStore, key: str, opener: Callable[[str, bytes], bytes]) -> list:
    with contextlib.suppress(NotFound):
        try:
            return parse_rows(opener(key, store.get(key, max_bytes=MAX_METRICS_BYTES)))
        except (SchemaError, StoreError) as e:
            log.warning("%s skipped: %s", key, e)
    return []


def trainer_rows(store: ObjectStore, trust: Trust) -> list[dict]:
    """The trainer's raw rows in order, from the segments it signed (others skipped)."""
    rows: list[dict] = []
    for _, key in _trainer_segments(store):
        rows += _segment_rows(store, key, trust.open_bytes)
    return rows


def worker_rows(inbox: ObjectStore) -> dict[str, list[dict]]:
    """{worker id: its raw rows in order} from the inbox."""
    out = {}
    for worker, segments in sorted(list_inbox(inbox).segments.items()):
        rows: list[dict] = []
        for _, key in segments:
            rows += _segment_rows(inbox, key, lambda k, d: d)
        out[worker] = rows
    return out


def read_trainer_rows(store: ObjectStore, trust: Trust) -> list[TrainerRow]:
    """The trainer's rows, in order; rows that fail their type are skipped."""
    return typed_rows(TrainerRow, trainer_rows(store, trust))


def read_worker_rows(inbox: ObjectStore) -> dict[str, list[WorkerRow]]:
    """{worker id: its rows, in order}; rows that fail their type are skipped."""
    return {w: typed_rows(WorkerRow, rows) for w, rows in worker_rows(inbox).items()}
