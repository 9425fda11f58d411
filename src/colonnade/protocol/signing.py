"""Signed rollout objects: ed25519 per worker, bound to the object's key.

An uploaded rollout object is

    b"CLNSIG1\\n" | signature (64 bytes) | payload (the encoded batch)

where the signature covers `key || 0x00 || payload`. Binding the key means
a valid object copied under another version, worker or sequence number
fails verification; the worker in the key names the public key to check
against, so a worker cannot sign for another. Replays of the same payload
under a fresh key of the same worker are caught by the trainer from the
payload digest.

Key files are small JSON documents: `{"worker": id, "private_key": hex}`
(mode 0600) and `{"worker": id, "public_key": hex}`.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import keys
from .schemas import SchemaError

MAGIC = b"CLNSIG1\n"
SIG_BYTES = 64


class SignatureRejected(SchemaError):
    """A rollout object that is unsigned, signed by an unknown key, or forged."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # unsigned | unknown_key | bad_signature


def _message(key: str, payload: bytes) -> bytes:
    return key.encode() + b"\x00" + payload


def sign(private: Ed25519PrivateKey, key: str, payload: bytes) -> bytes:
    return MAGIC + private.sign(_message(key, payload)) + payload


def verify(data: bytes, key: str, keyring: dict[str, Ed25519PublicKey]) -> bytes:
    """The payload of a signed object at `key`; raises SignatureRejected."""
    parsed = keys.parse_rollout_key(key)
    worker = parsed[1] if parsed else ""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + SIG_BYTES:
        raise SignatureRejected("unsigned", f"{key} carries no signature")
    public = keyring.get(worker)
    if public is None:
        raise SignatureRejected("unknown_key", f"worker {worker!r} has no registered key")
    sig = data[len(MAGIC) : len(MAGIC) + SIG_BYTES]
    payload = data[len(MAGIC) + SIG_BYTES :]
    try:
        public.verify(sig, _message(key, payload))
    except InvalidSignature:
        raise SignatureRejected("bad_signature", f"{key}: signature does not verify") from None
    return payload


def strip_unsigned(data: bytes) -> bytes:
    """The payload of an object in a run that does not require signatures."""
    if data.startswith(MAGIC) and len(data) >= len(MAGIC) + SIG_BYTES:
        return data[len(MAGIC) + SIG_BYTES :]
    return data


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


# -- key files -------------------------------------------------------------------------


def new_keypair(worker: str, out: Path) -> tuple[Path, Path]:
    """Write `{worker}.key` (0600) and `{worker}.pub` under `out`; refuses to overwrite."""
    keys.check_worker_id(worker)
    out.mkdir(parents=True, exist_ok=True)
    private = Ed25519PrivateKey.generate()
    raw = private.private_bytes_raw().hex()
    pub = private.public_key().public_bytes_raw().hex()
    key_path, pub_path = out / f"{worker}.key", out / f"{worker}.pub"
    for p in (key_path, pub_path):
        if p.exists():
            raise FileExistsError(f"{p} exists; keys are never overwritten")
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"worker": worker, "private_key": raw}, f)
    pub_path.write_text(json.dumps({"worker": worker, "public_key": pub}) + "\n")
    return key_path, pub_path


def _read(path: Path, field: str) -> tuple[str, bytes]:
    try:
        doc = json.loads(Path(path).read_text())
        worker, value = keys.check_worker_id(doc["worker"]), bytes.fromhex(doc[field])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a colonnade {field.split('_')[0]} key file ({e})") from None
    if len(value) != 32:
        raise ValueError(f"{path}: {field} must be 32 bytes")
    return worker, value


def load_private(path: Path) -> tuple[str, Ed25519PrivateKey]:
    worker, raw = _read(path, "private_key")
    return worker, Ed25519PrivateKey.from_private_bytes(raw)


def load_keyring(path: Path) -> dict[str, Ed25519PublicKey]:
    """Public keys from a `.pub` file or every `*.pub` in a directory."""
    path = Path(path)
    files = sorted(path.glob("*.pub")) if path.is_dir() else [path]
    ring: dict[str, Ed25519PublicKey] = {}
    for f in files:
        worker, raw = _read(f, "public_key")
        if worker in ring:
            raise ValueError(f"{f}: a second key for worker {worker!r}")
        ring[worker] = Ed25519PublicKey.from_public_bytes(raw)
    if not ring:
        raise ValueError(f"{path}: no public keys (*.pub)")
    return ring


def keyring_json(ring: dict[str, Ed25519PublicKey]) -> bytes:
    """The registered keys as published in the store (`trainer/keys.json`)."""
    doc = {w: k.public_bytes_raw().hex() for w, k in sorted(ring.items())}
    return json.dumps(doc, indent=1).encode()
