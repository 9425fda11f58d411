"""Every worker's figures on one Prometheus endpoint, read from the store.

A worker at home cannot be scraped, but its metric rows reach the inbox
(telemetry/rows.py: `{worker}/metrics/{seg}.jsonl`). A `FleetReader` reads
them and feeds an `Exporter` as the worker's own exporter is fed, row by
row through `Exporter.observe`: the same metric names, labelled
role="worker", id=<its id>, so the dashboard's queries read both alike. The
trainer's exporter runs one over the inbox (train/lead.py); `colonnade
exporter STORE` runs one over the inbox and the trainer's own signed
segments (`follow_run`), on any machine that can read the store.

Reading is incremental and bounded. A poll is one LIST of the inbox (and,
for the trainer's rows, one of its segments); a segment is fetched again
only when its store time changed, and only its rows past those already fed
are fed: a segment grows by appending, and once full it is never written
again. So a counter, fed each row's increment as the writer's own exporter
does, never goes back. A writer is followed from the newest segment it has
when first seen: Prometheus makes rates of counters, and what came before is
the report's. At most `max_workers` ids are followed (in a signed run,
registered ones only; a worker whose newest segment is older than
`forget_seconds` is dropped with its series, which makes room), and a poll
fetches at most `max_fetches` segments of at most `MAX_SEGMENT_BYTES` each,
every call under the store's own timeouts.

Everything in the inbox is a stranger's: a segment that does not read (too
large, not JSON lines, a trainer segment the trainer did not sign) is
skipped and counted (`colonnade_fleet_skipped_segments_total`), as is a row
that fails its type (`colonnade_fleet_skipped_rows_total`); nothing one
object holds stops the reader. An unavailable store ends the poll, counted
(`colonnade_fleet_poll_errors_total`); the next poll tries again.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter, Gauge

from colonnade.protocol import keys
from colonnade.protocol.inbox import scan
from colonnade.protocol.metrics import TrainerRow, WorkerRow
from colonnade.protocol.reader import RunView
from colonnade.protocol.schemas import MAX_JSON_BYTES, SchemaError
from colonnade.protocol.signing import Trust
from colonnade.store import NotFound, ObjectStore, StoreError, StoreUnavailable

from .exporter import Exporter
from .rows import MAX_METRICS_BYTES, SEGMENT_ROWS, parse_rows

log = logging.getLogger("colonnade.telemetry")
POLL_SECONDS = 15.0  # workers flush their rows every 10 s by default
MAX_WORKERS = 256  # label values: Prometheus keeps a series per id and metric
MAX_FETCHES = 64  # GETs a poll may make; what is left waits for the next poll
# A worker's segment holds SEGMENT_ROWS flat rows of a few hundred bytes; the
# trainer's carry per-worker tables, and its own bound (`MAX_METRICS_BYTES`).
MAX_SEGMENT_BYTES = 8 << 20
FORGET_SECONDS = 3600.0  # the trainer's default forget_workers_seconds
TRAINER_ID = "main"  # the trainer's id in its series, as its own exporter labels it


# A store time is coarse (S3's: a second): a segment read this soon after its
# store time may have been written again within the same tick, and is read
# once more at the next poll.
TIME_SLACK_SECONDS = 2.0


@dataclass
class _Segment:
    time: float  # its store time when last read
    rows: int  # rows fed (every JSON object of it, typed or not)
    closed: bool  # read once a later segment existed: never written again
    sure: bool = True  # read long enough after its store time (TIME_SLACK_SECONDS)

    @property
    def final(self) -> bool:
        return self.closed or self.rows >= SEGMENT_ROWS

    def stale(self, at: float, newest: bool) -> bool:
        """Whether a segment listed at store time `at` may hold rows not read."""
        return not self.final and (at != self.time or not newest or not self.sure)


@dataclass
class _Writer:
    """One writer's segments as followed: those below `floor` are done."""

    floor: int
    read: dict[int, _Segment] = field(default_factory=dict)


@dataclass(frozen=True)
class _Source:
    """Where a role's segments are, and how one reads."""

    role: str
    store: ObjectStore
    opener: Callable[[str, bytes], bytes]  # key, bytes -> the JSON lines
    row: type  # TrainerRow or WorkerRow
    max_bytes: int


def _unsigned(key: str, data: bytes) -> bytes:
    return data


class FleetReader:
    """Feeds `exporter` the rows of every worker in `inbox` (and, given
    `trainer` (the run's store and trust), the trainer's), one `poll` at a
    time, or every few seconds once `start`ed. `registered()`: the ids a
    signed run takes (None: any id)."""

    def __init__(
        self,
        exporter: Exporter,
        inbox: ObjectStore,
        registered: Callable[[], set[str] | None] = lambda: None,
        trainer: tuple[ObjectStore, Trust] | None = None,
        *,
        max_workers: int = MAX_WORKERS,
        max_fetches: int = MAX_FETCHES,
        forget_seconds: float = FORGET_SECONDS,
    ):
        self.exporter, self.inbox, self.registered = exporter, inbox, registered
        self.max_workers, self.max_fetches = max_workers, max_fetches
        self.forget_seconds = forget_seconds
        self.workers_source = _Source("worker", inbox, _unsigned, WorkerRow, MAX_SEGMENT_BYTES)
        self.trainer_source = None
        if trainer is not None:
            store, trust = trainer
            self.trainer_source = _Source(
                "trainer", store, trust.open_bytes, TrainerRow, MAX_METRICS_BYTES
            )
        self.trainer = _Writer(floor=-1)
        self.workers: dict[str, _Writer] = {}
        self._budget = 0
        self._turn = 0  # where the next poll starts among the workers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        registry = exporter.registry
        self.skipped_segments = Counter(
            "colonnade_fleet_skipped_segments",
            "metric segments in the store skipped: too large, not rows, not signed",
            registry=registry,
        )
        self.skipped_rows = Counter(
            "colonnade_fleet_skipped_rows",
            "metric rows in the store skipped: not of their row's type",
            registry=registry,
        )
        self.poll_errors = Counter(
            "colonnade_fleet_poll_errors",
            "polls of the store cut short (unavailable, or an error)",
            registry=registry,
        )
        self.followed = Gauge(
            "colonnade_fleet_workers",
            "worker ids whose rows this endpoint serves (ignored: past the cap)",
            ("state",),
            registry=registry,
        )

    # -- polling ---------------------------------------------------------------------------
    def start(self, seconds: float = POLL_SECONDS) -> FleetReader:
        """Poll every `seconds` in a daemon thread until `stop`."""
        self._thread = threading.Thread(
            target=self._loop, args=(seconds,), name="colonnade-fleet", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self, seconds: float) -> None:
        while not self._stop.is_set():
            self.poll_safely()
            self._stop.wait(seconds)

    def poll_safely(self) -> bool:
        """`poll`, with any failure logged and counted: the endpoint serves
        its own process's figures whatever the store or its objects do."""
        try:
            self.poll()
            return True
        except Exception as e:  # a reader's failure must not end the process
            self.poll_errors.inc()
            log.warning("fleet metrics: poll cut short (%s: %s)", type(e).__name__, e)
            return False

    def poll(self) -> None:
        """Read what changed since the last poll; StoreUnavailable ends it."""
        self._budget = self.max_fetches
        if self.trainer_source is not None:
            self._poll_trainer(self.trainer_source)
        self._poll_workers()

    def _poll_trainer(self, src: _Source) -> None:
        times = src.store.list_times(keys.TRAINER_METRICS)
        segments = sorted(
            (n, k) for k, at in times.items() if (n := keys.parse_trainer_segment(k)) is not None
        )
        if segments:
            if self.trainer.floor < 0:  # first seen: from its newest segment on
                self.trainer.floor = segments[-1][0]
            self._follow(src, TRAINER_ID, self.trainer, segments, times)

    def _poll_workers(self) -> None:
        times = self.inbox.list_times("")
        listing = scan(times, self.registered())
        fresh = {}
        horizon = time.time() - self.forget_seconds
        for worker, segments in listing.segments.items():
            if times[segments[-1][1]] >= horizon:
                fresh[worker] = segments
        for worker in [w for w in self.workers if w not in fresh]:
            self._forget(worker)
        ignored = 0
        for worker in sorted(fresh):
            if worker not in self.workers:
                if len(self.workers) >= self.max_workers:
                    ignored += 1
                    continue
                self.workers[worker] = _Writer(floor=fresh[worker][-1][0])
        self.followed.labels("followed").set(len(self.workers))
        self.followed.labels("ignored").set(ignored)
        order = sorted(self.workers)
        if not order:
            return
        # A poll whose fetches run out stops where it is; the next starts there.
        start = self._turn % len(order)
        for worker in order[start:] + order[:start]:
            if not self._follow(
                self.workers_source, worker, self.workers[worker], fresh[worker], times
            ):
                self._turn = order.index(worker)
                return
        self._turn = 0

    def _forget(self, worker: str) -> None:
        """A worker silent past `forget_seconds` (or no longer registered):
        its series end, and its slot is free."""
        del self.workers[worker]
        self.exporter.forget("worker", worker)

    # -- one writer ------------------------------------------------------------------------
    def _follow(
        self,
        src: _Source,
        ident: str,
        writer: _Writer,
        segments: list[tuple[int, str]],
        times: dict[str, float],
    ) -> bool:
        """Feed the rows of `segments` ([(n, key)], sorted) not fed yet;
        False once the poll's fetches are spent."""
        newest = segments[-1][0]
        for n, key in segments:
            if n < writer.floor:
                continue
            seen = writer.read.get(n)
            # One that stopped growing is read once more after a later one
            # appears: its last write may share its store time with the one read.
            if seen is None or seen.stale(times[key], n == newest):
                if self._budget <= 0:
                    return False
                self._budget -= 1
                self._read(src, ident, writer, n, key, times[key], closed=n < newest)
        # Done: the segments up to the first one that may still grow.
        listed = [n for n, _ in segments if n >= writer.floor]
        open_ = [n for n in listed if not (n in writer.read and writer.read[n].final)]
        writer.floor = min(open_) if open_ else newest + 1
        writer.read = {n: s for n, s in writer.read.items() if n >= writer.floor}
        return True

    def _read(
        self, src: _Source, ident: str, writer: _Writer, n: int, key: str, at: float, closed: bool
    ) -> None:
        before = writer.read.get(n)
        done = before.rows if before is not None else 0
        try:
            data = src.opener(key, src.store.get(key, max_bytes=src.max_bytes))
        except NotFound:  # deleted since the listing
            return
        except StoreUnavailable:
            raise
        except (StoreError, SchemaError) as e:  # too large, not the trainer's, ...
            self._skip(key, e)
            writer.read[n] = _Segment(at, done, closed)
            return
        rows = parse_rows(data)
        if not rows and data.strip():
            self._skip(key, "no rows")
            writer.read[n] = _Segment(at, done, closed)
            return
        for raw in rows[done:]:
            try:
                row = src.row.from_dict(raw)
            except SchemaError:
                self.skipped_rows.inc()
                continue
            self.exporter.observe(src.role, row.to_dict(), ident)
        sure = time.time() - at > TIME_SLACK_SECONDS
        writer.read[n] = _Segment(at, max(done, len(rows)), closed, sure)

    def _skip(self, key: str, why: object) -> None:
        self.skipped_segments.inc()
        log.warning("fleet metrics: %s skipped: %s", key, why)


# -- a run's store, from outside ---------------------------------------------------------------
def registered_ids(store: ObjectStore, trust: Trust) -> set[str]:
    """The ids the trainer registered (`trainer/keys.json`, as it signed it);
    none while there is none that verifies."""
    try:
        doc = trust.open(keys.KEYRING, store.get(keys.KEYRING, max_bytes=MAX_JSON_BYTES))
    except (NotFound, SchemaError):
        return set()
    return {w for w in doc if isinstance(w, str)}


def follow_run(store: ObjectStore, view: RunView, exporter: Exporter) -> FleetReader:
    """A reader of the whole run under `store` (opened as `view`): the
    trainer's signed rows and every registered (in an open run, every)
    worker's."""

    def registered() -> set[str] | None:
        return registered_ids(store, view.trust) if view.spec.signed else None

    return FleetReader(exporter, view.inbox, registered, trainer=(store, view.trust))
