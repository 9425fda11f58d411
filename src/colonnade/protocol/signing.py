"""Signatures: who wrote an object, bound to its run and its key.

Two parties sign (docs/security.md, "Who signs what"):

- the trainer signs every document a worker acts on (run.json, each
  version's meta.json, latest.json with its demand, the quarantine list,
  done.json) and what its own resume reads back (ledgers, checkpoint
  state, heartbeat, metric segments); workers and the operator's tools
  verify against the key they pinned;
- a worker signs its rollout batches and claims with its registered key.

Every signature covers `DOMAIN | run_id | 0 | object key | 0 | payload`, so
a signed object copied under another key (another version, worker or
sequence number), or into another run of the same key, fails.

A pipeline stage's message on a direct link (`rollout/stagelink.py`) is
signed apart, in a header beside its bytes: over `LINK_DOMAIN | run_id | 0 |
message key | 0 | SHA-256 of the message`, so that a message of up to
256 MiB is hashed once, not handed whole to ed25519, and a link signature
can never stand for an object's.

Two envelopes carry a signature:

- bytes (rollout batches, metric segments): `MAGIC | 64-byte signature | payload`;
- JSON documents: `{"protocol", "run", "key", "doc", "signature"}`, the
  signature over the document's canonical JSON (`schemas.dumps`, which is
  what a reader re-serialises the parsed document to: the signature holds
  the meaning, not the spelling). `protocol` stays at the top, so an older
  release reading run.json still finds the version and refuses it naming
  both. A worker's document in a run without keys carries `signature: ""`.

Key files are small JSON documents: `{"worker": id, "private_key": hex}`
(mode 0600) and `{"worker": id, "public_key": hex}`; the trainer's key is
one of these with the id `trainer`. A key's fingerprint is
`SHA256:` + the URL-safe base64 of the SHA-256 of its 32 raw bytes.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from . import keys
from .schemas import MAX_JSON_BYTES, ProtocolMismatch, SchemaError, _mismatch, dumps, loads

MAGIC = b"CLNSIG1\n"
SIG_BYTES = 64
DOMAIN = b"colonnade-signed\0"
LINK_DOMAIN = b"colonnade-stage-link\0"
ENVELOPE = ("protocol", "run", "key", "doc", "signature")
_HEX_SIG = re.compile(r"[0-9a-f]{128}")
_FINGERPRINT = re.compile(r"SHA256:[A-Za-z0-9_-]{43}")


class SignatureRejected(SchemaError):
    """An object that is unsigned, signed by a key we do not take, or forged."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason  # unsigned | unknown_key | bad_signature | wrong_key


def _message(run_id: str, key: str, payload: bytes) -> bytes:
    return DOMAIN + run_id.encode() + b"\0" + key.encode() + b"\0" + payload


def fingerprint(public: Ed25519PublicKey) -> str:
    digest = hashlib.sha256(public.public_bytes_raw()).digest()
    return "SHA256:" + base64.urlsafe_b64encode(digest).decode().rstrip("=")


def is_fingerprint(text: str) -> bool:
    return isinstance(text, str) and _FINGERPRINT.fullmatch(text) is not None


def public_hex(public: Ed25519PublicKey) -> str:
    return public.public_bytes_raw().hex()


def public_from_hex(text: Any) -> Ed25519PublicKey:
    """A public key from 64 hex characters; SchemaError otherwise."""
    if not isinstance(text, str) or not re.fullmatch(r"[0-9a-f]{64}", text):
        raise SchemaError("a public key is 64 lowercase hex characters")
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(text))


# -- bytes envelopes --------------------------------------------------------------------


def sign(private: Ed25519PrivateKey, run_id: str, key: str, payload: bytes) -> bytes:
    return MAGIC + private.sign(_message(run_id, key, payload)) + payload


def _split(data: bytes, key: str) -> tuple[bytes, bytes]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + SIG_BYTES:
        raise SignatureRejected("unsigned", f"{key} carries no signature")
    return data[len(MAGIC) : len(MAGIC) + SIG_BYTES], data[len(MAGIC) + SIG_BYTES :]


def verify_bytes(data: bytes, run_id: str, key: str, public: Ed25519PublicKey) -> bytes:
    """The payload of a signed object at `key`; raises SignatureRejected."""
    sig, payload = _split(data, key)
    try:
        public.verify(sig, _message(run_id, key, payload))
    except InvalidSignature:
        raise SignatureRejected("bad_signature", f"{key}: signature does not verify") from None
    return payload


def verify(
    data: bytes, run_id: str, key: str, keyring: dict[str, Ed25519PublicKey], worker: str
) -> bytes:
    """The payload of `worker`'s signed object at `key`, checked against its
    registered key; raises SignatureRejected."""
    _split(data, key)
    public = keyring.get(worker)
    if public is None:
        raise SignatureRejected("unknown_key", f"worker {worker!r} has no registered key")
    return verify_bytes(data, run_id, key, public)


def _link_message(run_id: str, key: str, payload: bytes) -> bytes:
    digest_ = hashlib.sha256(payload).digest()
    return LINK_DOMAIN + run_id.encode() + b"\0" + key.encode() + b"\0" + digest_


def sign_link(private: Ed25519PrivateKey, run_id: str, key: str, payload: bytes) -> str:
    """A stage message's signature on a direct link, as 128 hex characters."""
    return private.sign(_link_message(run_id, key, payload)).hex()


def verify_link(
    signature: str, run_id: str, key: str, payload: bytes, public: Ed25519PublicKey
) -> None:
    """Raises SignatureRejected unless `signature` (hex) is `public`'s over
    the message at `key`."""
    if not isinstance(signature, str) or not _HEX_SIG.fullmatch(signature):
        raise SignatureRejected("unsigned", f"{key} carries no signature")
    try:
        public.verify(bytes.fromhex(signature), _link_message(run_id, key, payload))
    except InvalidSignature:
        raise SignatureRejected("bad_signature", f"{key}: signature does not verify") from None


def strip_unsigned(data: bytes) -> bytes:
    """The payload of an object in a run that does not require signatures."""
    if data.startswith(MAGIC) and len(data) >= len(MAGIC) + SIG_BYTES:
        return data[len(MAGIC) + SIG_BYTES :]
    return data


def digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


# -- JSON envelopes ---------------------------------------------------------------------


def seal_doc(private: Ed25519PrivateKey | None, run_id: str, key: str, doc: dict) -> bytes:
    """The document as its signed envelope (unsigned: `signature` is "")."""
    sig = private.sign(_message(run_id, key, dumps(doc))).hex() if private is not None else ""
    env = {"protocol": keys.PROTOCOL_VERSION, "run": run_id, "key": key, "doc": doc,
           "signature": sig}  # fmt: skip
    return dumps(env)


def read_envelope(data: bytes, key: str, limit: int = MAX_JSON_BYTES) -> dict:
    """The envelope of a document at `key`, its form checked, not its signature."""
    env = loads(data, limit, unique=True)
    p = env.get("protocol")
    if not (isinstance(p, int) and not isinstance(p, bool) and p == keys.PROTOCOL_VERSION):
        what = "run.json" if key == keys.RUN else key
        hint = "run it with the release that started the run"
        raise _mismatch(what, env.get("protocol"), hint)
    if set(env) != set(ENVELOPE):
        raise SchemaError(f"{key}: envelope fields differ: {sorted(set(env) ^ set(ENVELOPE))}")
    if env["key"] != key:
        raise SignatureRejected("bad_signature", f"{key}: signed for {str(env['key'])[:80]!r}")
    if not isinstance(env["run"], str) or not isinstance(env["doc"], dict):
        raise SchemaError(f"{key}: run is a string and doc an object")
    sig = env["signature"]
    if not isinstance(sig, str) or not (sig == "" or _HEX_SIG.fullmatch(sig)):
        raise SchemaError(f"{key}: signature is 128 lowercase hex characters or empty")
    return env


def open_doc(env: dict, run_id: str, public: Ed25519PublicKey) -> dict:
    """The document of a checked envelope signed by `public` for `run_id`."""
    key = env["key"]
    if env["run"] != run_id:
        raise SignatureRejected("bad_signature", f"{key}: signed for another run")
    if not env["signature"]:
        raise SignatureRejected("unsigned", f"{key} carries no signature")
    try:
        public.verify(bytes.fromhex(env["signature"]), _message(run_id, key, dumps(env["doc"])))
    except InvalidSignature:
        raise SignatureRejected("bad_signature", f"{key}: signature does not verify") from None
    return env["doc"]


@dataclass(frozen=True)
class Trust:
    """A trainer's public key and its run: what a reader checks the trainer's
    documents against."""

    public: Ed25519PublicKey
    run_id: str

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)

    def open(self, key: str, data: bytes, limit: int = MAX_JSON_BYTES) -> dict:
        """The trainer's document at `key`; SignatureRejected, SchemaError."""
        return open_doc(read_envelope(data, key, limit), self.run_id, self.public)

    def open_bytes(self, key: str, data: bytes) -> bytes:
        return verify_bytes(data, self.run_id, key, self.public)


@dataclass(frozen=True)
class Signer:
    """The trainer's private key, for one run."""

    private: Ed25519PrivateKey
    run_id: str

    @property
    def public(self) -> Ed25519PublicKey:
        return self.private.public_key()

    @property
    def trust(self) -> Trust:
        return Trust(self.public, self.run_id)

    def seal(self, key: str, doc: dict) -> bytes:
        return seal_doc(self.private, self.run_id, key, doc)

    def seal_bytes(self, key: str, payload: bytes) -> bytes:
        return sign(self.private, self.run_id, key, payload)


def read_run_envelope(data: bytes, trusted: str | None) -> tuple[dict, Trust]:
    """run.json: (its document, the trust it establishes), verified against the
    key it names, which must have fingerprint `trusted` when one is given.

    SignatureRejected("wrong_key") when the run is signed by another key than
    the trusted one; ProtocolMismatch for a run of another release."""
    env = read_envelope(data, keys.RUN)
    doc = env["doc"]
    public = public_from_hex(doc.get("trainer_key"))
    if trusted is not None and fingerprint(public) != trusted:
        raise SignatureRejected(
            "wrong_key", f"run.json is signed by {fingerprint(public)}, not the trusted {trusted}"
        )
    run_id = doc.get("run_id")
    if not isinstance(run_id, str):
        raise SchemaError("run.json: run_id is a string")
    return open_doc(env, run_id, public), Trust(public, run_id)


# -- key files -------------------------------------------------------------------------


def new_keypair(worker: str, out: Path) -> tuple[Path, Path]:
    """Write `{worker}.key` (0600) and `{worker}.pub` under `out`; refuses to overwrite."""
    keys.check_worker_id(worker)
    out.mkdir(parents=True, exist_ok=True)
    key_path, pub_path = out / f"{worker}.key", out / f"{worker}.pub"
    for p in (key_path, pub_path):
        if p.exists():
            raise FileExistsError(f"{p} exists; keys are never overwritten")
    write_private(key_path, worker, Ed25519PrivateKey.generate())
    return key_path, pub_path


def write_private(key_path: Path, worker: str, private: Ed25519PrivateKey) -> None:
    """`key_path` (0600, created, never overwritten) and the `.pub` beside it."""
    raw = private.private_bytes_raw().hex()
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"worker": worker, "private_key": raw}, f)
    pub = public_hex(private.public_key())
    key_path.with_suffix(".pub").write_text(
        json.dumps({"worker": worker, "public_key": pub}) + "\n"
    )


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


def load_public(path: Path) -> tuple[str, Ed25519PublicKey]:
    """(id, public key) of a `.pub` file, or of a `.key` file's public half."""
    try:
        worker, raw = _read(path, "public_key")
        return worker, Ed25519PublicKey.from_public_bytes(raw)
    except ValueError:
        worker, private = load_private(path)
        return worker, private.public_key()


def trusted_fingerprint(value: str) -> str:
    """A `--trust` value (a key file or a fingerprint) as a fingerprint; ValueError."""
    if is_fingerprint(value):
        return value
    if Path(value).is_file():
        return fingerprint(load_public(Path(value))[1])
    raise ValueError(
        f"--trust {value!r}: neither a key file nor a fingerprint (SHA256:…, as "
        "`colonnade keys fingerprint FILE` prints it)"
    )


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


def keyring_json(ring: dict[str, Ed25519PublicKey]) -> dict:
    """The registered keys as published in the store (`trainer/keys.json`'s document)."""
    return {w: public_hex(k) for w, k in sorted(ring.items())}


__all__ = ["ProtocolMismatch", "SignatureRejected", "Signer", "Trust"]
