"""A hostile process with the credentials a worker would share: it may write
anywhere in the run's store and its inbox, and it holds one registered
worker key of its own (`w3`). Run by tests/faults/test_hostile_fleet.py:

    python hostile_writer.py ROOT KEYDIR STOP_FILE

Until STOP_FILE exists it keeps forging what workers and the trainer act
on: done flags and pointers to versions that do not exist, the next version
(meta and weights), future meta.json keys, a quarantine list naming the
honest workers, ghost and garbage claims, batches under another worker's
name and re-signed copies of theirs; once, a flood of junk objects. It
prints one line per kind of attack it made, for the test to check.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from colonnade.protocol import keys
from colonnade.protocol.documents import Claim, seal_claim
from colonnade.protocol.schemas import decode_batch, dumps, encode_batch, loads
from colonnade.protocol.signing import Signer, load_private, seal_doc, sign, strip_unsigned
from colonnade.store import LocalStore, StoreError

FLOOD = int(os.environ.get("HOSTILE_FLOOD", "20000"))
done: set[str] = set()


def said(kind: str) -> None:
    if kind not in done:
        done.add(kind)
        print(f"attack: {kind}", flush=True)


def run_id(store: LocalStore) -> str | None:
    try:
        return loads(store.get(keys.RUN))["doc"]["run_id"]
    except (StoreError, KeyError, ValueError):
        return None


def newest(store: LocalStore) -> int:
    """The newest version the trainer wrote a patch for (the attacker's own
    squatted meta.json keys would run away with a count of metas)."""
    found = [v for k in store.list(keys.WEIGHTS) if k.endswith("/patch.pulse")
             and (v := keys.parse_weights_key(k)) is not None]  # fmt: skip
    return max(found, default=0)


copied: set[str] = set()  # w1's batches already copied
seen: dict = {}  # the last latest.json document of the trainer's envelope read


def forge_pointers(store: LocalStore, evil: Signer, rid: str, v: int, tick: int) -> None:
    latest = loads(store.get(keys.LATEST))
    if "doc" in latest and latest.get("signature"):  # an envelope (ours or the trainer's)
        seen.update(doc=latest["doc"])
    if "doc" not in seen:
        return
    doc = dict(seen["doc"])
    choice = tick % 3
    if choice == 0:  # the run is over (unsigned)
        store.put(keys.LATEST, dumps({**doc, "done": True}))
        said("done flag, unsigned")
    elif choice == 1:  # a huge version, signed by another key
        meta = {**doc["meta"], "version": 999_999, "anchor": 999_999}
        store.put(keys.LATEST, evil.seal(keys.LATEST, {**doc, "version": 999_999, "meta": meta}))
        said("huge version, forged signature")
    else:  # done, signed by another key
        store.put(keys.LATEST, evil.seal(keys.LATEST, {**doc, "done": True}))
        said("done flag, forged signature")
    # The next version, meta and weights, before the trainer makes it.
    nxt = v + 1
    if not store.exists(keys.meta_key(nxt)):
        store.put(keys.full_key(nxt), os.urandom(4096))
        meta = {**doc["meta"], "version": nxt, "anchor": nxt, "patch_bytes": 0, "patch_hash": "",
                "anchor_bytes": 4096, "anchor_hash": "sha256:" + "0" * 64}  # fmt: skip
        store.put_if_absent(keys.meta_key(nxt), evil.seal(keys.meta_key(nxt), meta))
        said("forged next version")
    # Future meta.json keys, squatted.
    store.put_if_absent(keys.meta_key(v + 2), b'{"garbage": true}')
    store.put_if_absent(
        keys.meta_key(v + 3), seal_doc(None, rid, keys.meta_key(v + 3), doc["meta"])
    )
    said("squatted future meta.json")
    # A quarantine list naming the honest workers.
    decisions = {w: {"reason": "forged", "version": v, "time": time.time()} for w in ("w1", "w2")}
    if tick % 2:
        store.put(keys.QUARANTINE, dumps(decisions))
    else:
        store.put(keys.QUARANTINE, evil.seal(keys.QUARANTINE, decisions))
    said("forged quarantine")


def forge_claims(inbox: LocalStore, w3: Signer, rid: str, v: int) -> None:
    for slot in range(0, 12):
        key = keys.claim_key(v, slot)
        ghost = Claim(f"ghost{random.randrange(10**6)}", time.time())
        inbox.put_if_absent(key, seal_claim(None, rid, key, ghost))  # unsigned ghost
    key = keys.claim_key(v, keys.MAX_SLOT)
    inbox.put_if_absent(key, seal_claim(None, rid, key, Claim("ghost", time.time())))
    inbox.put_if_absent(keys.claim_key(v, 13), b"\x00garbage")
    key = keys.claim_key(v, 14)  # a claim in w1's name, signed by w3
    inbox.put_if_absent(key, seal_claim(w3.private, rid, key, Claim("w1", time.time())))
    said("ghost and garbage claims")


def forge_batches(inbox: LocalStore, w3: Signer, rid: str, v: int) -> None:
    for key in inbox.list("w1/rollouts/"):
        parsed = keys.parse_rollout_key(key)
        if parsed is None or key in copied:
            continue
        copied.add(key)
        data = inbox.get(key)
        # The same bytes under w2's name: the signature binds the key.
        inbox.put_if_absent(keys.rollout_key(parsed[0], "w2", 900_000 + parsed[2]), data)
        said("batch under another worker's name")
        # Re-signed by w3, a registered key the attacker holds.
        try:
            batch = decode_batch(strip_unsigned(data), 1 << 20, 1 << 16)
        except Exception:
            continue
        batch.worker, batch.seq = "w3", parsed[2]
        rkey = keys.rollout_key(parsed[0], "w3", parsed[2])
        inbox.put_if_absent(rkey, sign(w3.private, rid, rkey, encode_batch(batch)))
        said("re-signed copy")


def flood(store: LocalStore, inbox: LocalStore, v: int) -> None:
    for i in range(FLOOD):
        r = i % 4
        if r == 0:
            inbox.put(f"junk{i}/rollouts/{v:08d}/000000.safetensors.zst", b"x" * 64)
        elif r == 1:
            inbox.put(f"zz/{i}/not-ours", b"x")
        elif r == 2:
            inbox.put(keys.claim_key(99_999_999 - i % 7, i % keys.MAX_SLOT), b"{}")
        else:
            inbox.put(keys.heartbeat_key(f"fake{i}"), json.dumps({"worker": f"fake{i}"}).encode())
    said(f"flood of {FLOOD} junk objects")


def main(root: str, keydir: str, stop: str) -> None:
    store = LocalStore(root)
    inbox = store.sub(keys.INBOX)
    while (rid := run_id(store)) is None:
        time.sleep(0.2)
    evil = Signer(Ed25519PrivateKey.generate(), rid)
    w3 = Signer(load_private(Path(keydir) / "w3.key")[1], rid)
    flooded, tick = False, 0
    while not Path(stop).exists():
        tick += 1
        try:
            v = newest(store)
            if not flooded:
                flood(store, inbox, v)
                flooded = True
            forge_pointers(store, evil, rid, v, tick)
            forge_claims(inbox, w3, rid, v)
            forge_batches(inbox, w3, rid, v)
        except (StoreError, KeyError, ValueError) as e:
            print(f"attack failed this tick: {e}", flush=True)
        time.sleep(0.3)


if __name__ == "__main__":
    main(*sys.argv[1:4])
