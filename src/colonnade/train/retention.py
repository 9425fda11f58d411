"""Retention: a run of thousands of versions keeps a bounded store and inbox.

After version v is published the trainer deletes what no one can use any
more:

- rollouts and claims of versions below v − max_lag (inbox): consumed,
  rejected or stale, no step can take them (the ledgers and metric rows
  keep their counts);
- ledgers of versions below v − max_lag: a resumed trainer needs the keys and
  content digests of the window only (anything older is out of it);
- weights below the newest anchor's previous anchor: a joiner needs the
  newest anchor and the patches after it; a follower up to one anchor window
  behind the newest anchor still finds its patches; older ones fall back to
  the anchor, as they would anyway;
- heartbeats of workers silent for `forget_workers_seconds` (an hour by
  default): a fleet with churn would otherwise list one more object per
  worker that ever joined. A worker that comes back writes a new one; its
  metric segments stay (they are the run's record);
- what no one should have written (protocol 7): inbox keys that are no key
  of ours, keys of ids a signed run does not register, rollouts and claims
  of versions not yet published, and objects under `weights/{u}/` for u
  beyond the newest version. A flood of junk is gone one version later.

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
from colonnade.protocol.inbox import Listing, list_inbox
from colonnade.protocol.presence import heartbeat_ages
from colonnade.store import ObjectStore, StoreError, StoreUnavailable

log = logging.getLogger("colonnade.trainer")


def garbage(listing: list[str], v: int, max_lag: int, anchor_every: int) -> list[str]:
    """The keys of the run's store among `listing` that no one can use once
    version v is published: old ledgers and weights, and weights beyond v."""
    newest_anchor = v - v % anchor_every
    out = []
    for key in listing:
        ledger, u = keys.parse_consumed_key(key), keys.parse_weights_key(key)
        if ledger is not None and ledger[0] < v - max_lag:
            out.append(key)
        elif u is not None and (u < newest_anchor - anchor_every or u > v):
            out.append(key)  # below the previous anchor, or no version yet
    return out


def inbox_garbage(listing: Listing, v: int, max_lag: int) -> list[str]:
    """The inbox keys no one can use once version v is published: old
    rollouts and claims, and everything `scan` set aside."""
    old = [k for u, found in listing.rollouts.items() if u < v - max_lag for k in found]
    old += [k for k, (u, _, _) in listing.claims.items() if u < v - max_lag]
    return sorted(old) + sorted(listing.junk) + sorted(listing.beyond)


def departed(ages: dict[str, float], after: float) -> list[str]:
    """The heartbeat keys of the workers among `ages` ({worker: seconds since
    its heartbeat}) silent for `after` seconds."""
    return sorted(keys.heartbeat_key(w) for w, age in ages.items() if age >= after)


@dataclass
class Retention:
    store: ObjectStore  # the run's
    inbox: ObjectStore
    max_lag: int
    anchor_every: int
    enabled: bool = True
    forget_workers_seconds: float = 3600.0
    deleted: int = 0  # objects deleted by this trainer

    def sweep(self, v: int, registered: set[str] | None = None) -> int:
        """Delete what version v makes useless; how many objects. `registered`:
        the ids a signed run takes (any other id's objects are junk)."""
        if not self.enabled:
            return 0
        listing = [k for prefix in (keys.CONSUMED, keys.WEIGHTS) for k in self.store.list(prefix)]
        doomed = garbage(listing, v, self.max_lag, self.anchor_every)
        # meta.json first, so a version is gone before its payloads are.
        doomed.sort(key=lambda k: (not k.endswith("/meta.json"), k))
        inbox = list_inbox(self.inbox, registered, v)
        ages = heartbeat_ages(inbox, time.time())
        junk = inbox_garbage(inbox, v, self.max_lag)
        junk += departed(ages, self.forget_workers_seconds)
        try:
            self.store.delete_many(doomed)
            self.inbox.delete_many(junk)
        except StoreUnavailable:
            raise
        except StoreError as e:
            self.enabled = False
            log.warning("the store refuses deletes (%s): retention is off for this run", e)
            return 0
        self.deleted += len(doomed) + len(junk)
        return len(doomed) + len(junk)
