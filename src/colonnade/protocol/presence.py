"""Who is in the run: the workers' heartbeats (`{worker}/heartbeat.json` in the inbox)."""

from __future__ import annotations

from colonnade.store import ObjectStore, StoreError, StoreUnavailable

from . import keys
from .documents import WorkerHeartbeat, read_document
from .inbox import Listing, list_inbox
from .schemas import SchemaError


def worker_heartbeats(
    inbox: ObjectStore, listing: Listing | None = None
) -> dict[str, WorkerHeartbeat]:
    """{worker id: heartbeat} of every worker that wrote one; one that does
    not read, or names another worker than its key, is skipped."""
    listing = listing or list_inbox(inbox)
    out = {}
    for worker in sorted(listing.heartbeats):
        try:
            hb = read_document(inbox, keys.heartbeat_key(worker), WorkerHeartbeat)
        except StoreUnavailable:
            raise
        except (StoreError, SchemaError):  # too large, not our JSON, not a heartbeat
            continue
        if hb is not None and hb.worker == worker:
            out[worker] = hb
    return out


def heartbeat_ages(listing: Listing, now: float) -> dict[str, float]:
    """{worker id: seconds since its heartbeat was written}, from a listing's
    store times (clocks assumed within a few seconds)."""
    return {w: now - t for w, t in listing.heartbeats.items()}


def fresh_workers(listing: Listing, now: float, timeout: float) -> set[str]:
    """Workers whose heartbeat was written in the last `timeout` seconds."""
    return {w for w, age in heartbeat_ages(listing, now).items() if age < timeout}


def alive(
    heartbeats: dict[str, WorkerHeartbeat], now: float, timeout: float
) -> dict[str, WorkerHeartbeat]:
    """The heartbeats younger than `timeout` seconds."""
    return {w: hb for w, hb in heartbeats.items() if now - hb.time < timeout}
