"""A worker heartbeat for tests: every field set, the ones a test cares about given."""

from __future__ import annotations

from colonnade.protocol.documents import WorkerHeartbeat


def worker_heartbeat(worker: str, **fields) -> WorkerHeartbeat:
    base = dict(worker=worker, host="h", platform="Linux", device="cpu", engine="int8-w8",
                threads=1, version=0, batches=0, bytes_synced=0, time=1.0, started=0.0)  # fmt: skip
    return WorkerHeartbeat(**{**base, **fields})
