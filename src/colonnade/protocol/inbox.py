"""The inbox: where workers write, and how the trainer reads it in one listing.

Workers write nothing to the run's store (protocol 7): claims, batches,
heartbeats and metric segments go to the inbox, a store of its own (a
second bucket, run.json's `inbox`) or the `inbox/` folder of the run's
store. Everything in it is a stranger's: `scan` turns one listing into what
the trainer may look at, and sets aside what it must not (keys that are no
key of ours, ids that are not registered in a signed run, versions outside
the window), for retention to delete. The trainer never reads an object it
set aside, so a flood of junk costs one listing's share, not a GET apiece.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from colonnade.store import ObjectStore, open_store

from . import keys
from .schemas import RunSpec


def open_inbox(
    run_store: ObjectStore,
    spec: RunSpec,
    *,
    endpoint_url: str | None = None,
    profile: str | None = None,
) -> ObjectStore:
    """The run's inbox as this process reaches it: run.json's own store when
    it names one (its endpoint, else this process's, else the run store's:
    the trainer records an inbox endpoint only where it differs), else the
    run store's `inbox/` folder."""
    if not spec.inbox:
        return run_store.sub(keys.INBOX) if profile is None else _reopened(run_store, profile)
    own = getattr(run_store, "endpoint_url", None)  # an S3Store's; None for a folder
    endpoint_url = spec.inbox_endpoint_url or endpoint_url or own
    return open_store(spec.inbox, endpoint_url=endpoint_url, profile=profile)


def _reopened(run_store: ObjectStore, profile: str) -> ObjectStore:
    """The inbox folder of the run's store, reached with other credentials."""
    from colonnade.store import S3Store

    if not isinstance(run_store, S3Store):
        return run_store.sub(keys.INBOX)
    other = S3Store(run_store.bucket, run_store.prefix, endpoint_url=run_store.endpoint_url,
                    profile=profile, max_put_bytes=run_store.max_put_bytes,
                    multipart_bytes=run_store.multipart_bytes)  # fmt: skip
    return other.sub(keys.INBOX)


@dataclass
class Listing:
    """One listing of the inbox, parsed: what the trainer may read, with store times."""

    rollouts: dict[int, dict[str, str]] = field(default_factory=dict)  # v -> {key: worker}
    rollout_times: dict[str, float] = field(default_factory=dict)  # rollout key -> store time
    claims: dict[str, tuple[int, int, float]] = field(default_factory=dict)  # key -> v, slot, at
    heartbeats: dict[str, float] = field(default_factory=dict)  # worker -> store time
    segments: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # worker -> [(n, key)]
    junk: list[str] = field(default_factory=list)  # not a key of ours, or not a registered id's
    beyond: list[str] = field(default_factory=list)  # rollouts and claims of versions > newest

    def rollout_keys(self, versions: range) -> dict[int, list[str]]:
        return {u: sorted(self.rollouts.get(u, {})) for u in versions}


def scan(
    times: dict[str, float], registered: set[str] | None = None, newest: int | None = None
) -> Listing:
    """Parse a listing of the inbox ({key: store time}). `registered`: the ids
    a signed run takes (others are junk); `newest`: the newest version that
    can exist (claims and rollouts above it are set aside)."""
    out = Listing()
    segments: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for key, at in times.items():
        claim = keys.parse_claim_key(key)
        if claim is not None:
            if newest is not None and claim[0] > newest + 1:  # the next version's slots may open
                out.beyond.append(key)
            else:
                out.claims[key] = (claim[0], claim[1], at)
            continue
        owner = keys.inbox_owner(key)
        if owner is None or (registered is not None and owner not in registered):
            out.junk.append(key)
            continue
        if (rollout := keys.parse_rollout_key(key)) is not None:
            if newest is not None and rollout[0] > newest:
                out.beyond.append(key)
            else:
                out.rollouts.setdefault(rollout[0], {})[key] = owner
                out.rollout_times[key] = at
        elif keys.parse_heartbeat_key(key) is not None:
            out.heartbeats[owner] = at
        elif (seg := keys.parse_worker_segment(key)) is not None:
            segments[owner].append((seg[1], key))
    out.segments = {w: sorted(s) for w, s in segments.items()}
    return out


def list_inbox(
    inbox: ObjectStore, registered: set[str] | None = None, newest: int | None = None
) -> Listing:
    """The inbox in one listing (`scan`)."""
    return scan(inbox.list_times(""), registered, newest)
