"""Who is in the run: the workers' heartbeats (`workers/{id}.json`)."""

from __future__ import annotations

from colonnade.store import ObjectStore, StoreError, StoreUnavailable

from .schemas import MAX_JSON_BYTES, loads


def worker_heartbeats(store: ObjectStore) -> dict[str, dict]:
    """{worker id: heartbeat} of every worker that wrote one; unreadable ones skipped."""
    out = {}
    for key in store.list("workers/"):
        try:
            hb = loads(store.get(key, max_bytes=MAX_JSON_BYTES))
        except StoreUnavailable:
            raise
        except (StoreError, ValueError):  # not an object, too large, not our JSON
            continue
        worker = hb.get("worker")
        out[worker if isinstance(worker, str) else key] = hb
    return out


def fresh_workers(store: ObjectStore, now: float, timeout: float) -> set[str]:
    """Workers whose heartbeat object was written in the last `timeout` seconds:
    one listing, however many workers (clocks assumed within a few seconds)."""
    out = set()
    for key, t in store.list_times("workers/").items():
        worker = key.removeprefix("workers/").removesuffix(".json")
        if key.endswith(".json") and "/" not in worker and now - t < timeout:
            out.add(worker)
    return out


def alive(heartbeats: dict[str, dict], now: float, timeout: float) -> dict[str, dict]:
    """The heartbeats younger than `timeout` seconds."""
    return {w: hb for w, hb in heartbeats.items() if now - float(hb.get("time", 0)) < timeout}
