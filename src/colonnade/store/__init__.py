"""The object store: the only link between the trainer and its workers.

`open_store(url)` picks the backend from the URL:
    /path/run, ./run, file:///path/run   -> LocalStore (a directory)
    s3://bucket/prefix                   -> S3Store (S3, R2, MinIO, SeaweedFS)
"""

from __future__ import annotations

import os
from urllib.parse import unquote, urlparse

from .base import DEFAULT_MAX_BYTES, ObjectStore, check_key
from .errors import (
    AccessDenied,
    BucketNotFound,
    InvalidKey,
    InvalidObject,
    NotFound,
    ObjectTooLarge,
    StoreError,
    StoreUnavailable,
)
from .local import LocalStore
from .s3 import S3Store

__all__ = [
    "DEFAULT_MAX_BYTES",
    "AccessDenied",
    "BucketNotFound",
    "InvalidKey",
    "InvalidObject",
    "LocalStore",
    "NotFound",
    "ObjectStore",
    "ObjectTooLarge",
    "S3Store",
    "StoreError",
    "StoreUnavailable",
    "check_key",
    "open_store",
]


def open_store(
    url: str, *, endpoint_url: str | None = None, profile: str | None = None, **kw
) -> ObjectStore:
    """A store for a URL; endpoint_url (or $AWS_ENDPOINT_URL_S3 / $AWS_ENDPOINT_URL)
    points s3:// at R2, MinIO or another S3-compatible service; `profile` names
    the credentials (~/.aws/credentials) for s3:// (default: the environment's)."""
    parsed = urlparse(url)
    if parsed.scheme in ("", "file") or (len(parsed.scheme) == 1 and os.name == "nt"):
        path = unquote(parsed.path) if parsed.scheme == "file" else url
        if parsed.scheme == "file" and parsed.netloc not in ("", "localhost"):
            raise ValueError(f"file:// URLs name a local path, not host {parsed.netloc!r}")
        return LocalStore(path, **kw)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"{url!r}: an s3:// URL needs a bucket (s3://bucket/prefix)")
        endpoint = (
            endpoint_url
            or os.environ.get("AWS_ENDPOINT_URL_S3")
            or os.environ.get("AWS_ENDPOINT_URL")
        )
        return S3Store(
            parsed.netloc, parsed.path.strip("/"), endpoint_url=endpoint, profile=profile, **kw
        )
    raise ValueError(
        f"unsupported store URL {url!r}: use a path, file:///path or s3://bucket/prefix"
    )
