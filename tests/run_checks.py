"""Checks of a finished run's store that several end-to-end tests share."""

from __future__ import annotations

import json

from colonnade import pulse
from colonnade.protocol import Follower, keys, read_meta


def check_versions(store, last: int, anchor_every: int) -> list:
    """Every version 0..last exists once and rebuilds to its hash on a fresh
    follower; their metas."""
    metas = [read_meta(store, v) for v in range(last + 1)]
    assert all(m is not None and m.version == v for v, m in enumerate(metas))
    for v in range(last + 1):
        f = Follower(store, anchor_every=anchor_every)
        f.sync(v)
        assert pulse.state_hash(f.state) == metas[v].state_hash
    return metas


def check_consumed(store, max_lag: int) -> dict[str, str]:
    """No batch consumed twice, each within max_lag of the version it trained;
    {batch key: ledger}."""
    seen: dict[str, str] = {}
    for ledger in store.list("trainer/consumed/"):
        trained = int(ledger.split("/")[-1].split("-")[0])
        for key in json.loads(store.get(ledger))["keys"]:
            assert key not in seen, f"{key} consumed by {seen[key]} and {ledger}"
            seen[key] = ledger
            assert trained - 1 - keys.parse_rollout_key(key)[0] <= max_lag
    assert seen, "no batches were consumed"
    return seen
