"""Gathering rollout batches for a step: fresh enough, unconsumed, verified.

The collector lists the inbox once per look (protocol/inbox.py), takes the
batches of the versions u the step may use (v − max_lag … v) whole, in
take order, until it has enough groups, and remembers every key it took,
so no batch trains twice, across restarts too (the trainer persists the
keys per version). Batches of versions that fell out of the window are counted once, as dropped.

Everything in the inbox comes from strangers. In a signed run a key under
an id that is not registered is never read (retention removes it); a
batch signed by another key than its worker's is rejected. Per-worker
counters exist for registered ids only (an open run: for ids that have had
a group accepted), so junk under fresh names grows no state. Whatever one object
holds (not a file, too large, a zstd bomb, a header nested to blow the stack,
bad schema or tensors, another protocol's batch, a signature that fails,
draws or spot-checked rows that prove a forgery, a tool service's reply
signed for another row, episodes that do not replay), it is
rejected, counted under a reason, and the collector moves on; only an
unavailable store is raised, to be retried. Replays are recognised by
content, not bytes: a group's digest covers its task and token ids, not
its version, so the same episodes re-encoded, re-signed under another name
or relabelled with a newer version are a replay (an honest group that
repeats an earlier one token for token is refused too: it would train the
same tokens twice), and a digest is remembered only once its group is accepted, so a
rejected copy cannot shut out the original. When two workers send the same
episodes, the first accepted wins and the other is counted as a replay.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from colonnade.protocol import ProtocolMismatch, SchemaError, decode_batch, keys
from colonnade.protocol.documents import Claim, open_claim
from colonnade.protocol.inbox import list_inbox
from colonnade.protocol.polling import FLOOR, poll_interval
from colonnade.protocol.schemas import MAX_BATCH_BYTES, GroupRecord, RolloutBatch, content_digest
from colonnade.protocol.signing import MAGIC, SIG_BYTES, SignatureRejected, strip_unsigned, verify
from colonnade.store import InvalidObject, NotFound, ObjectStore, ObjectTooLarge, StoreUnavailable

from . import trust
from .replies import misbound
from .samples import Sample
from .trust import UNTRUSTED, untrusted

log = logging.getLogger("colonnade.trainer")


@dataclass
class Collected:
    groups: list[list[Sample]]
    keys: list[str]  # batches trained on (at least one group accepted)
    staleness: Counter  # version lag -> groups
    wait_seconds: float
    digests: list[str] = field(default_factory=list)  # content digests of the groups taken
    rejected: list[str] = field(default_factory=list)  # batches taken and refused whole


def take_order(fresh: dict[int, list[str]], expiring: int | None = None) -> list[str]:
    """The order to take batches in: those of version `expiring` first, then
    newest version first; workers in turn within a version.

    `expiring` is the window's oldest version when the step's window reaches
    back (max_lag >= 1): no later step can take those batches, and since
    protocol 4 every batch was asked for (train/demand.py), so one left now
    is waste. Newest first after that keeps staleness low; taking workers in
    turn within a version keeps one fast worker from crowding out the rest.
    """
    out: list[str] = []
    order = sorted(fresh, reverse=True)
    if expiring in fresh:
        order = [expiring] + [v for v in order if v != expiring]
    for v in order:
        by_worker: dict[str, list[str]] = {}
        for key in sorted(fresh[v]):
            parsed = keys.parse_rollout_key(key)
            by_worker.setdefault(parsed[1] if parsed else "", []).append(key)
        queues = [by_worker[w] for w in sorted(by_worker)]
        for i in range(max(map(len, queues), default=0)):
            out.extend(q[i] for q in queues if i < len(q))
    return out


@dataclass
class Collector:
    store: ObjectStore  # the inbox
    run_id: str  # signatures bind it
    rebuild: Callable  # (GroupRecord, version) -> list[Sample]; raises Rejected
    vocab: int
    max_tokens: int
    max_lag: int
    poll_seconds: float = 1.0
    version_gap: float | None = None  # seconds between versions, set by the trainer
    consumed: set[str] = field(default_factory=set)
    swept_below: int = 0  # versions below this were counted as dropped
    counts: Counter = field(default_factory=Counter)  # named as protocol.metrics.is_count says
    per_worker: dict[str, Counter] = field(default_factory=dict)
    keyring: dict | None = None  # worker -> public key; None: signatures not required
    # worker -> public key whose rewards the trainer takes where it cannot
    # recompute them (train/trust.py); None: nobody's
    trusted: dict | None = None
    # (batch) -> why its randomness is not the run's, or None (`protocol.draws`);
    # None: draws are not checked (a collector outside a run)
    check_draws: Callable[[RolloutBatch], str | None] | None = None
    # (batch) -> the proof that a row it recomputed is forged, or None
    # (train/spot.py); None: no spot checks
    spot: Callable[[RolloutBatch], str | None] | None = None
    forged: dict[str, str] = field(default_factory=dict)  # worker -> proof, until judged
    claimants: dict[str, str | None] = field(default_factory=dict)  # claim key -> its worker
    seen: set[str] = field(default_factory=set)  # content digests of groups trained on
    quarantined: set[str] = field(default_factory=set)  # workers whose batches are refused
    max_raw: int = MAX_BATCH_BYTES  # decompressed bytes a batch of this run may hold

    def _stats(self, worker: str) -> Counter:
        """The worker's counters: registered ids, or (an open run) ids with a
        group accepted; a throwaway for anyone else."""
        if worker in self.per_worker or self.keyring is not None:
            return self.per_worker.setdefault(worker, Counter())
        return Counter()

    def _reject(self, key: str, worker: str, reason: str, error: Exception) -> list:
        log.warning("rejected batch %s (%s): %s", key, reason, str(error)[:200])
        self.counts["batches_rejected"] += 1
        self.counts[f"rejected_{reason}"] += 1
        stats = self._stats(worker)
        stats["batches_rejected"] += 1
        stats[f"rejected_{reason}"] += 1
        return []

    def _payload(self, key: str, data: bytes, worker: str) -> bytes:
        if self.keyring is None:
            return strip_unsigned(data)
        return verify(data, self.run_id, key, self.keyring, worker)

    def _sweep(self, v: int, listing) -> None:
        lowest = max(0, v - self.max_lag)
        for u in range(self.swept_below, lowest):
            stale = [k for k in listing.rollouts.get(u, {}) if k not in self.consumed]
            self.counts["batches_dropped_stale"] += len(stale)
        # The window moved: what is below it is no longer looked at (nor kept).
        self.consumed = {k for k in self.consumed
                         if (p := keys.parse_rollout_key(k)) is None or p[0] >= lowest}  # fmt: skip
        self.swept_below = max(self.swept_below, lowest)

    def _read(self, key: str, version: int, worker: str):
        """The batch at `key`, or a rejection reason and the error; an
        unavailable store is raised."""
        try:
            # A batch compresses its raw bound at worst into about that much:
            # larger is refused before a byte of it is decompressed.
            bound = min(MAX_BATCH_BYTES, self.max_raw + (self.max_raw >> 7) + (1 << 16))
            data = self.store.get(key, max_bytes=bound + len(MAGIC) + SIG_BYTES)
            batch = decode_batch(self._payload(key, data, worker), self.vocab, self.max_tokens,
                                 self.max_raw)  # fmt: skip
            if batch.version != version or batch.worker != worker:
                raise SchemaError("batch names another version or worker than its key")
            return batch, None
        except StoreUnavailable:
            raise
        except SignatureRejected as e:
            return None, (e.reason, e)
        except (InvalidObject, ObjectTooLarge, NotFound) as e:
            return None, ("object", e)
        except ProtocolMismatch as e:  # a worker of another release
            return None, ("protocol", e)
        except SchemaError as e:
            return None, ("schema", e)
        except Exception as e:  # the trust boundary: no object may stop the trainer
            return None, ("invalid", e)

    def _group(self, g: GroupRecord, version: int, worker: str, fresh: set[str]):
        """(samples, None), or (None, "replay" | "rejected"), counted."""
        stats = self._stats(worker)
        d = content_digest(g)
        if d in self.seen or d in fresh:
            self.counts["groups_replayed"] += 1
            stats["groups_replayed"] += 1
            return None, "replay"
        try:
            samples = self.rebuild(g, version)
        except Exception as e:  # Rejected, or anything the replay tripped over
            self.counts["groups_rejected"] += 1
            stats["groups_rejected"] += 1
            log.warning("rejected a group of %s from %s: %s", g.task_id[:64], worker, e)
            if reason := getattr(e, "reason", ""):  # e.g. a tool reply altered
                self.counts[f"groups_rejected_{reason}"] += 1
                stats[f"groups_rejected_{reason}"] += 1
            return None, "rejected"
        if (why := untrusted(samples, worker, self.trusted, self.keyring)) is not None:
            return self._reject_group(g, worker, why, UNTRUSTED, stats)
        fresh.add(d)
        trust.count(samples, self.counts)
        self.counts["episodes_overflow"] += sum(e.finish == "overflow" for e in g.episodes)
        for sample in samples:
            sample.worker = worker
        return samples, None

    def _reject_group(self, g: GroupRecord, worker: str, why: str, reason: str, stats):
        self.counts["groups_rejected"] += 1
        stats["groups_rejected"] += 1
        self.counts[f"groups_rejected_{reason}"] += 1
        stats[f"groups_rejected_{reason}"] += 1
        log.warning("rejected a group of %s from %s: %s", g.task_id[:64], worker, why)
        return None, "rejected"

    def _take(self, key: str, v: int, out: Collected) -> list[list[Sample]]:
        parsed = keys.parse_rollout_key(key)
        if parsed is None:
            return []
        version, worker, _ = parsed
        batch, why = (None, ("quarantined", SchemaError("worker is quarantined")))
        if worker not in self.quarantined:
            batch, why = self._read(key, version, worker)
        if batch is not None and self.check_draws is not None and self._claimant(batch) != worker:
            claim = f"slot {batch.slot} of v{version}"
            batch, why = None, ("unclaimed", SchemaError(f"{claim} is not {worker}'s claim"))
        if batch is not None and (bad := misbound(batch, self.run_id)) is not None:
            batch, why = None, ("tool_reply", SchemaError(bad))
        if batch is not None and (proof := self._forgery(batch)) is not None:
            # One proven forgery is enough: refused from now on, quarantined
            # at the next judgement.
            self.forged.setdefault(worker, proof)
            self.quarantined.add(worker)
            batch, why = None, ("forged", SchemaError(proof))
        if batch is not None:
            fresh: set[str] = set()
            taken = [self._group(g, version, worker, fresh) for g in batch.groups]
            groups = [samples for samples, _ in taken if samples is not None]
            if groups:
                self.seen |= fresh
                out.digests.extend(sorted(fresh))
                out.keys.append(key)
                self.counts[f"batches_from_{batch.engine}"] += 1
                self.per_worker.setdefault(worker, Counter())["groups"] += len(groups)
                return groups
            replays = all(reason == "replay" for _, reason in taken)
            why = ("replay" if replays else "groups", SchemaError("no group was accepted"))
        out.rejected.append(key)
        return self._reject(key, worker, *why)

    def _forgery(self, batch: RolloutBatch) -> str | None:
        """The proof that `batch` was not sampled as the run says, or None:
        its draws (every token, free), then a spot check of some rows."""
        proof = self.check_draws(batch) if self.check_draws is not None else None
        if proof is None and self.spot is not None:
            proof = self.spot(batch)
        return proof

    def _claimant(self, batch: RolloutBatch) -> str | None:
        """Who holds the claim `batch` names (None: nobody we accept; read once)."""
        key = keys.claim_key(batch.version, batch.slot)
        if key not in self.claimants:
            try:
                data = self.store.get(key, max_bytes=Claim.MAX_BYTES)
                self.claimants[key] = open_claim(data, key, self.run_id, self.keyring).worker
            except StoreUnavailable:
                raise
            except NotFound:
                return None  # not cached: a claim is written before its batch
            except Exception:  # the trust boundary: not a claim we accept
                self.claimants[key] = None
        return self.claimants[key]

    def collect(
        self,
        v: int,
        need: int,
        timeout: float | None = None,
        stop: Callable[[int], bool] | None = None,
    ) -> Collected:
        """At least `need` groups made with versions v − max_lag … v.

        Fewer on timeout, or when `stop(groups taken so far)` turns true while
        waiting (the trainer also refreshes its demand there).
        """
        t0, last_report = time.monotonic(), time.monotonic()
        out = Collected([], [], Counter(), 0.0)
        polls = 0
        registered = set(self.keyring) if self.keyring is not None else None
        while len(out.groups) < need:
            listing = list_inbox(self.store, registered, v)
            self._sweep(v, listing)
            fresh = {
                u: [k for k in keys_ if k not in self.consumed]
                for u, keys_ in listing.rollout_keys(range(max(0, v - self.max_lag), v + 1)).items()
            }
            lowest = max(0, v - self.max_lag)
            for key in take_order(fresh, lowest if lowest < v else None):
                groups = self._take(key, v, out)
                self.consumed.add(key)
                for g in groups:
                    out.staleness[v - g[0].version] += 1
                out.groups.extend(groups)
                if len(out.groups) >= need:
                    break
            if len(out.groups) >= need:
                break
            waited = time.monotonic() - t0
            if stop is not None and stop(len(out.groups)):
                break
            if timeout is not None and waited > timeout:
                log.warning("gave up waiting for rollouts after %.0f s", waited)
                break
            if time.monotonic() - last_report > 10:
                log.info(
                    "waiting for rollouts: %d/%d groups for v%d (%.0f s)",
                    len(out.groups),
                    need,
                    v,
                    waited,
                )
                last_report = time.monotonic()
            # Short polls first, then a tenth of a version's time: a fixed 1 s
            # poll left the smoke preset's trainer waiting long after its
            # groups had landed (docs/benchmarks.md).
            cap = poll_interval(self.version_gap, self.poll_seconds)
            time.sleep(min(cap, FLOOR * 2 ** min(polls, 16)))
            polls += 1
        out.wait_seconds = time.monotonic() - t0
        return out
