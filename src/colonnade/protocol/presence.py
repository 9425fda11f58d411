"""Who is in the run: the workers' heartbeats (`workers/{id}.json`)."""

from __future__ import annotations

from colonnade.store import ObjectStore, StoreError, StoreUnavailable

from . import keys
from .documents import WorkerHeartbeat, read_document
from .schemas import SchemaError


def worker_heartbeats(store: ObjectStore) -> dict[str, WorkerHeartbeat]:
    """{worker id: heartbeat} of every worker that wrote one; one that does
    not read, or names another worker than its key, is skipped."""
    out = {}
    for key in store.list(keys.WORKERS):
        worker = keys.parse_worker_key(key)
        if worker is None:
            continue
        try:
            hb = read_document(store, key, WorkerHeartbeat)
        except StoreUnavailable:
            raise
        except (StoreError, SchemaError):  # too large, not our JSON, not a heartbeat
            continue
        if hb is not None and hb.worker == worker:
            out[worker] = hb
    return out


def heartbeat_ages(store: ObjectStore, now: float) -> dict[str, float]:
    """{worker id: seconds since its heartbeat was written}: one listing,
    however many workers (clocks assumed within a few seconds)."""
    out = {}
    for key, t in store.list_times(keys.WORKERS).items():
        worker = keys.parse_worker_key(key)
        if worker is not None:
            out[worker] = now - t
    return out


def fresh_workers(store: ObjectStore, now: float, timeout: float) -> set[str]:
    """Workers whose heartbeat was written in the last `timeout` seconds."""
    return {w for w, age in heartbeat_ages(store, now).items() if age < timeout}


def alive(
    heartbeats: dict[str, WorkerHeartbeat], now: float, timeout: float
) -> dict[str, WorkerHeartbeat]:
    """The heartbeats younger than `timeout` seconds."""
    return {w: hb for w, hb in heartbeats.items() if now - hb.time < timeout}
