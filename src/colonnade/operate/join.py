"""Join strings: what an operator hands a worker so that it can join a run.

`colonnade invite` makes one (`make_invite`), `colonnade worker --join`
reads it (`apply_join`). A join string is `colonnade1:` and the URL-safe
base64 (unpadded) of an `Invite`'s canonical JSON: the run's store and its
S3 endpoint, the inbox where workers write, the fingerprint of the
trainer's key and the run's environment. The worker pins that key, so a
run.json signed by any other is refused; the environment is named so that
a worker without its package says so at once instead of after joining.

A join string holds no secret: no credentials (a worker takes them from its
own environment or AWS profile, as without one), no private key, and no URL
that carries one (`user:password@host`, a presigned query). The number in
the prefix is the format's version: a string of another format is refused,
naming both, rather than read as this one.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import importlib.util
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from colonnade.config import WorkerConfig
from colonnade.protocol import keys
from colonnade.protocol.schemas import MAX_JSON_BYTES, RunSpec, SchemaError, dumps, loads
from colonnade.protocol.signing import is_fingerprint, read_run_envelope, trusted_fingerprint
from colonnade.store import NotFound, ObjectStore, open_store

FORMAT = 1
PREFIX = f"colonnade{FORMAT}:"
# Far above an honest join string (a few hundred characters): a pasted blob
# is refused before it is decoded.
MAX_CHARS = 4096
_MAX_URL = 1024
_ENV = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,199}")
_BASE64 = re.compile(r"[A-Za-z0-9_-]+")
_ANY_FORMAT = re.compile(r"colonnade([0-9]{1,6}):(.*)", re.DOTALL)
log = logging.getLogger("colonnade.join")


class JoinError(ValueError):
    """A join string, or what an invite is made of, that cannot be used."""


@dataclass(frozen=True)
class Invite:
    """What a worker needs to join a run besides its own credentials and key."""

    store: str  # the run's store: s3://bucket/prefix, or a directory on this machine
    trainer_key: str  # fingerprint (SHA256:…) of the key that signs run.json
    env: str  # the run's environment: its package must be importable on the worker
    endpoint: str | None = None  # the run store's S3 endpoint; None: AWS (or the worker's own)
    inbox: str = ""  # where workers write; "": the `inbox/` folder of the run's store
    inbox_endpoint: str | None = None  # the inbox's S3 endpoint, where it differs

    def check(self) -> None:
        """JoinError naming the first field that is not what a worker can use."""
        _check_store("store", self.store)
        if self.inbox:
            _check_store("inbox", self.inbox)
        for name in ("endpoint", "inbox_endpoint"):
            if (value := getattr(self, name)) is not None:
                _check_endpoint(name, value)
        if not is_fingerprint(self.trainer_key):
            raise JoinError("join string: trainer_key is a fingerprint (SHA256:…)")
        if not isinstance(self.env, str) or not _ENV.fullmatch(self.env):
            raise JoinError(f"join string: env {str(self.env)[:80]!r} is no environment name")

    def encode(self) -> str:
        """The join string (fields left at their default are left out)."""
        self.check()
        doc = {k: v for k, v in dataclasses.asdict(self).items() if v not in (None, "")}
        return PREFIX + base64.urlsafe_b64encode(dumps(doc)).decode().rstrip("=")

    @classmethod
    def decode(cls, text: str) -> Invite:
        """The invite of a join string; JoinError saying what is wrong with it.

        Whitespace is dropped first: a string wrapped by a mail client or a
        terminal still reads."""
        text = "".join(str(text).split())
        if len(text) > MAX_CHARS:
            raise JoinError(f"join string: {len(text)} characters, more than {MAX_CHARS}")
        m = _ANY_FORMAT.fullmatch(text)
        if not m:
            raise JoinError(
                f"not a join string: one starts with {PREFIX} (`colonnade invite` prints it)"
            )
        if int(m[1]) != FORMAT:
            raise JoinError(
                f"a join string of format {int(m[1])}; this colonnade reads format {FORMAT} "
                "(install the release the operator runs)"
            )
        return cls._from_doc(_unpack(m[2]))

    @classmethod
    def _from_doc(cls, doc: dict) -> Invite:
        fields = {f.name for f in dataclasses.fields(cls)}
        required = {"store", "trainer_key", "env"}
        if unknown := sorted(set(doc) - fields):
            raise JoinError(f"join string: unknown field(s) {', '.join(unknown)}")
        if missing := sorted(required - set(doc)):
            raise JoinError(f"join string: missing field(s) {', '.join(missing)}")
        if bad := sorted(k for k, v in doc.items() if not isinstance(v, str)):
            raise JoinError(f"join string: field(s) {', '.join(bad)} must be strings")
        invite = cls(**doc)
        invite.check()
        return invite

    def describe(self) -> str:
        """One line for a person: where the run is and whom it trusts."""
        where = f"{self.store} ({self.endpoint})" if self.endpoint else self.store
        inbox = self.inbox or "the inbox/ folder of the store"
        if self.inbox and self.inbox_endpoint:
            inbox += f" ({self.inbox_endpoint})"
        return f"run {where}, workers write to {inbox}, env {self.env}, trainer {self.trainer_key}"


def _unpack(body: str) -> dict:
    if not _BASE64.fullmatch(body):
        raise JoinError("join string: not URL-safe base64 after the prefix (cut short or altered?)")
    try:
        raw = base64.urlsafe_b64decode(body + "=" * (-len(body) % 4))
        return loads(raw, MAX_JSON_BYTES, unique=True)
    except (binascii.Error, SchemaError) as e:
        raise JoinError(f"join string: cut short or altered? ({e})") from None


def _check_url_parts(name: str, value: str) -> None:
    if not isinstance(value, str) or not value or len(value) > _MAX_URL:
        raise JoinError(f"join string: {name} is a URL of 1 to {_MAX_URL} characters")
    if any(c.isspace() or not c.isprintable() for c in value):
        raise JoinError(f"join string: {name} holds whitespace or control characters")
    parts = urlsplit(value)
    # A secret may ride in a URL: a user and password, or a presigned query.
    if "@" in parts.netloc or parts.query or parts.fragment:
        raise JoinError(  # without the URL: it may hold the secret
            f"{name}: a URL with a user, a query or a fragment may carry a secret, and a join "
            "string never does (workers take credentials from their own environment)"
        )


def _check_store(name: str, value: str) -> None:
    _check_url_parts(name, value)
    parts = urlsplit(value)
    if parts.scheme == "s3":
        if not parts.netloc:
            raise JoinError(f"{name} {value[:80]!r}: an s3:// URL names a bucket")
    elif parts.scheme not in ("", "file") and not (len(parts.scheme) == 1 and os.name == "nt"):
        raise JoinError(f"{name} {value[:80]!r}: s3://bucket/prefix or a directory")


def _check_endpoint(name: str, value: str) -> None:
    _check_url_parts(name, value)
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise JoinError(f"{name} {value[:80]!r}: an http:// or https:// URL")


def _local_dir(url: str) -> Path | None:
    """The directory a store URL names; None for s3://."""
    parts = urlsplit(url)
    if parts.scheme == "file":
        return Path(unquote(parts.path))
    if parts.scheme == "" or (len(parts.scheme) == 1 and os.name == "nt"):
        return Path(url).expanduser()
    return None


def _store_url(url: str) -> str:
    """A directory as an absolute path (a worker starts elsewhere); a URL as it is."""
    scheme = urlsplit(url).scheme
    if scheme == "" or (len(scheme) == 1 and os.name == "nt"):
        return str(Path(url).expanduser().resolve())
    return url


def make_invite(
    store: str,
    *,
    endpoint: str | None = None,
    profile: str | None = None,
    key: str = "",
    inbox: str | None = None,
    inbox_endpoint: str | None = None,
    env: str | None = None,
) -> Invite:
    """The invite to the run under `store`.

    The trainer's key, the environment and the inbox come from the run's
    run.json, verified against the key it names (and against `key`, a key
    file or fingerprint, when given); a value given that differs from it is
    refused. Before the trainer has written run.json, `key` and `env` are
    needed. `profile` names the credentials run.json is read with; it is not
    part of the invite. Raises JoinError, or the store's error."""
    trusted = trusted_fingerprint(key) if key else None
    _check_store("--store", store)
    url = _store_url(store)
    opened, endpoint = _open(url, endpoint, profile)
    run = _signed_run(opened, trusted)
    if run is None:
        if trusted is None or not env:
            raise JoinError(
                f"no run.json under {url} yet: pass --key (the trainer's .pub file or "
                "fingerprint) and --env, or start the trainer first"
            )
        return _invite(url, trusted, env, endpoint, inbox or "", inbox_endpoint)
    spec, signer = run
    given = {"env": (env, spec.env), "inbox": (inbox, spec.inbox),
             "inbox_endpoint": (inbox_endpoint, spec.inbox_endpoint_url)}  # fmt: skip
    for name, (value, recorded) in given.items():
        if value is not None and value != recorded:
            raise JoinError(
                f"--{name.replace('_', '-')} {value} but the run's run.json says "
                f"{recorded or 'none'}"
            )
    return _invite(url, signer, spec.env, endpoint, spec.inbox, spec.inbox_endpoint_url)


def _open(url: str, endpoint: str | None, profile: str | None):
    """(the store, the endpoint it resolved to: the one given, else
    AWS_ENDPOINT_URL*); no store for a directory that is not there, which
    opening would make."""
    folder = _local_dir(url)
    if folder is not None and not folder.is_dir():
        return None, endpoint
    opened = open_store(url, endpoint_url=endpoint, profile=profile)
    return opened, endpoint or getattr(opened, "endpoint_url", None)


def _signed_run(opened: ObjectStore | None, trusted: str | None) -> tuple[RunSpec, str] | None:
    """run.json and the fingerprint of the key that signed it (which must be
    `trusted`, when given); None before the trainer has written it."""
    if opened is None:
        return None
    try:
        doc, trust = read_run_envelope(opened.get(keys.RUN, max_bytes=MAX_JSON_BYTES), trusted)
    except NotFound:
        return None
    return RunSpec.from_dict(doc), trust.fingerprint


def _invite(url, trainer_key, env, endpoint, inbox, inbox_endpoint) -> Invite:
    invite = Invite(url, trainer_key, env, endpoint, inbox, inbox_endpoint)
    invite.check()
    return invite


def env_missing(env: str) -> bool:
    """Whether the environment `env` names is an import path that cannot be
    found here (the built-ins and `prefix:` families ship with colonnade)."""
    from colonnade.envs.registry import BUILTINS, PREFIXES

    prefix, sep, _ = env.partition(":")
    if env in BUILTINS or (sep and prefix in PREFIXES):
        return False
    try:
        return importlib.util.find_spec(env) is None
    except (ImportError, ValueError):  # a parent package that is not there
        return True


def apply_join(cfg: WorkerConfig) -> WorkerConfig:
    """`cfg` with its join string's settings: the store, its endpoint and the
    trainer's key to pin. A store or --trust given too must agree with the
    string; an endpoint given beats it (the same store may be reached at
    another address). Raises JoinError (or ValueError for a --trust that
    names no key)."""
    if not cfg.join:
        return cfg
    invite = Invite.decode(cfg.join)
    if cfg.store and _store_url(cfg.store) != invite.store:
        raise JoinError(f"--store {cfg.store} but the join string names {invite.store}")
    if cfg.trust and trusted_fingerprint(cfg.trust) != invite.trainer_key:
        raise JoinError(
            f"--trust names another key than the join string's trainer {invite.trainer_key}"
        )
    if env_missing(invite.env):
        raise JoinError(
            f"the run's environment {invite.env!r} cannot be imported here: install its "
            "package on this worker (every worker needs it, as the trainer does)"
        )
    log.info("joining the %s", invite.describe())
    return dataclasses.replace(
        cfg,
        store=invite.store,
        endpoint_url=cfg.endpoint_url or invite.endpoint,
        trust=invite.trainer_key,
    )
