"""Checks of a finished run's store that several end-to-end tests share.

Every document is read as a worker or the report reads it: through the key
that signed run.json (`open_run`), or the `trust` given."""

from __future__ import annotations

from colonnade import pulse
from colonnade.protocol import Follower, keys, read_meta
from colonnade.protocol.documents import ConsumedLedger, read_signed
from colonnade.protocol.reader import open_run
from colonnade.protocol.signing import Trust


def check_versions(store, last: int, anchor_every: int, trust: Trust | None = None) -> list:
    """Every version 0..last exists once, signed by the trainer, and rebuilds
    to its hash on a fresh follower; their metas."""
    trust = trust or open_run(store).trust
    metas = [read_meta(store, v, trust) for v in range(last + 1)]
    assert all(m is not None and m.version == v for v, m in enumerate(metas))
    for v in range(last + 1):
        f = Follower(store, anchor_every=anchor_every, trust=trust)
        f.sync(v)
        assert pulse.state_hash(f.state) == metas[v].state_hash
    return metas


def check_consumed(store, max_lag: int, trust: Trust | None = None) -> dict[str, str]:
    """No batch consumed twice, each within max_lag of the version it trained,
    every ledger signed by the trainer; {batch key: ledger}."""
    trust = trust or open_run(store).trust
    seen: dict[str, str] = {}
    for ledger in store.list(keys.CONSUMED):
        trained, _ = keys.parse_consumed_key(ledger)
        doc = read_signed(store, ledger, ConsumedLedger, trust)
        for key in doc.keys:
            assert key not in seen, f"{key} consumed by {seen[key]} and {ledger}"
            seen[key] = ledger
            assert trained - 1 - keys.parse_rollout_key(key)[0] <= max_lag
    assert seen, "no batches were consumed"
    return seen
