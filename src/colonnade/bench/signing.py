"""`colonnade bench signing`: what signing and checking cost a real run.

One smoke run (`colonnade run`, the trainer and its workers as processes)
is timed end to end. Then every object that run signed or checked is
counted from what it left (the trainer's documents in the run's store, the
workers' batches and claims in the inbox, the versions every worker read)
and each kind is signed and verified again here, at its real size, timed
(median of repeats): signing and checking cost = Σ count × (sign + verify),
against the run's wall time. Side by side in one process, so the ratio does
not depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from colonnade.protocol import keys


def _median_seconds(fn, repeats: int) -> float:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def op_cost(payload: bytes, key: str, json_doc: bool, repeats: int = 50) -> float:
    """Seconds to sign and verify one object like `payload` at `key`."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from colonnade.protocol.schemas import loads
    from colonnade.protocol.signing import Signer

    signer = Signer(Ed25519PrivateKey.generate(), "bench0000000")
    trust = signer.trust
    if json_doc:
        doc = loads(payload)["doc"]  # an envelope: signed again here, as its writer did
        sealed = signer.seal(key, doc)
        return _median_seconds(lambda: signer.seal(key, doc), repeats) + _median_seconds(
            lambda: trust.open(key, sealed), repeats
        )
    sealed = signer.seal_bytes(key, payload)
    return _median_seconds(lambda: signer.seal_bytes(key, payload), repeats) + _median_seconds(
        lambda: trust.open_bytes(key, sealed), repeats
    )


def measure(out: Path, versions: int, workers: int) -> dict:
    from colonnade.launch import resolve_run_config
    from colonnade.launch.run import launch
    from colonnade.protocol.reader import open_run
    from colonnade.protocol.signing import strip_unsigned
    from colonnade.store import LocalStore

    cfg = resolve_run_config(
        "smoke", out=str(out), workers=workers, eval_n=0, live=False,
        trainer={"max_versions": versions, "retain_all": True},
    )  # fmt: skip
    t0 = time.perf_counter()
    report = launch(cfg)
    wall = time.perf_counter() - t0
    if report["status"] != "finished":
        raise SystemExit(f"error: the run in {out} ended {report['status']}")
    store = LocalStore(out / "store")
    inbox = open_run(store).inbox
    rows = []
    # The trainer's documents: each signed once, checked by every worker
    # that reads it (latest.json and meta.json: every worker, every version).
    docs = [k for k in store.list("") if k.endswith(".json") and not k.startswith(keys.REPORT)]
    readers = workers + 1
    for kind, match, per in (
        # latest.json: rewritten with each version and demand, polled ~3 times a version.
        ("latest.json", lambda k: k == keys.LATEST, 3 * versions * readers),
        ("meta.json", lambda k: keys.parse_meta_key(k) is not None, readers),
        ("other trainer documents", lambda k: True, 1),
    ):
        found = [k for k in docs if match(k)]
        docs = [k for k in docs if k not in found]
        if found:
            cost = op_cost(store.get(found[0]), found[0], json_doc=True)
            rows.append((kind, len(found) * per, cost))
    batches = [k for k in inbox.list("") if keys.parse_rollout_key(k) is not None]
    if batches:
        data = inbox.get(batches[0])
        rows.append(("rollout batches", len(batches), op_cost(strip_unsigned(data), batches[0],
                                                               False)))  # fmt: skip
    claims = [k for k in inbox.list(keys.CLAIMS) if keys.parse_claim_key(k) is not None]
    if claims:
        rows.append(("claims", len(claims), op_cost(inbox.get(claims[0]), claims[0], True)))
    total = sum(n * c for _, n, c in rows)
    return {
        "wall_s": round(wall, 2),
        "rows": [{"what": w, "objects": n, "us_per_object": round(c * 1e6, 1)} for w, n, c in rows],
        "signing_s": round(total, 4),
        "fraction_of_wall": round(total / wall, 5),
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--versions", type=int, default=10, help="versions of the smoke run")
    p.add_argument("--workers", type=int, default=2, help="workers of the smoke run")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="colonnade-bench-signing-") as tmp:
        res = measure(Path(tmp) / "run", args.versions, args.workers)
    if args.json:
        print(json.dumps(res))
        return 0
    print(f"{'object':<26}{'count':>8}{'sign+verify us':>16}")
    for r in res["rows"]:
        print(f"{r['what']:<26}{r['objects']:>8}{r['us_per_object']:>16}")
    print(f"signing and checking: {res['signing_s']:.3f} s of a {res['wall_s']:.1f} s run "
          f"({100 * res['fraction_of_wall']:.3f}%)")  # fmt: skip
    return 0
