"""Retention: a run of thousands of versions keeps a bounded store.

After version v is published the trainer deletes what no one can use any
more (`garbage`):

- rollouts of versions below v − max_lag: consumed, rejected or stale, no
  step can take them (the ledgers and metric rows keep their counts);
- claims of versions below v − max_lag: the demand counts only the window's
  (a claim of an older version could not bring a usable batch);
- ledgers of versions below v − max_lag: a resumed trainer needs the keys and
  content digests of the window only (anything older is out of it);
- weights below the newest anchor's previous anchor: a joiner needs the
  newest anchor and the patches after it; a follower up to one anchor window
  behind the newest anchor still finds its patches; older ones fall back to
  the anchor, as they would anyway;
- heartbeats of workers silent for `forget_workers_seconds` (an hour by
  default): a fleet with churn would otherwise list one more object per
  worker that ever joined. A worker that comes back writes a new one; its
  metric segments stay (they are the run's record).

Checkpoints are pruned where they are written (`keep_checkpoints`). Deletes
run in the publication's background job, off the critical path. A store
that refuses deletes (a bucket policy) turns retention off with one warning;
the run goes on. `retain_all` keeps everything, for audits. The same can be
done server-side with a lifecycle rule (docs/protocol.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from colonnade.protocol import keys
from colonnade.protocol.presence import heartbeat_ages
from colonnade.store import ObjectStore, StoreError, StoreUnavailable

log = logging.getLogger("colonnade.trainer")


def _owner(key: str) -> tuple[str, int] | None:
    """(what, version) of a key retention may delete: a rollout, a claim, a
    ledger or a version's weights; None for anything else."""
    if (ledger := keys.parse_consumed_key(key)) is not None:
        return "ledger", ledger[0]
    return keys.parse_version_dir(key)


def garbage(listing: list[str], v: int, max_lag: int, anchor_every: int) -> list[str]:
    """The keys among `listing` that no one can use once version v is published."""
    newest_anchor = v - v % anchor_every
    below = {
        "rollouts": v - max_lag,  # the oldest version a step may still take
        "claims": v - max_lag,
        "ledger": v - max_lag,
        "weights": newest_anchor - anchor_every,  # the previous anchor, and on
    }
    out = []
    for key in listing:
        owner = _owner(key)
        if owner is not None and owner[1] < below[owner[0]]:
            out.append(key)
    return out


def departed(ages: dict[str, float], after: float) -> list[str]:
    """The heartbeat keys of the workers among `ages` ({worker: seconds since
    its heartbeat}) silent for `after` seconds."""
    return sorted(keys.worker_key(w) for w, age in ages.items() if age >= after)


@dataclass
class Retention:
    store: ObjectStore
    max_lag: int
    anchor_every: int
    enabled: bool = True
    forget_workers_seconds: float = 3600.0
    deleted: int = 0  # objects deleted by this trainer

    def sweep(self, v: int) -> int:
        """Delete what version v makes useless; how many objects."""
        if not self.enabled:
            return 0
        listing = [
            k
            for prefix in (keys.ROLLOUTS, keys.CLAIMS, keys.CONSUMED, keys.WEIGHTS)
            for k in self.store.list(prefix)
        ]
        doomed = garbage(listing, v, self.max_lag, self.anchor_every)
        # meta.json first, so a version is gone before its payloads are.
        doomed.sort(key=lambda k: (not k.endswith("/meta.json"), k))
        doomed += departed(heartbeat_ages(self.store, time.time()), self.forget_workers_seconds)
        try:
            self.store.delete_many(doomed)
        except StoreUnavailable:
            raise
        except StoreError as e:
            self.enabled = False
            log.warning("the store refuses deletes (%s): retention is off for this run", e)
            return 0
        self.deleted += len(doomed)
        return len(doomed)
