"""Typed errors from a real S3 server: bad secret, missing bucket, dead endpoint."""

import socket
import time

import pytest

from colonnade.store import AccessDenied, BucketNotFound, S3Store, StoreUnavailable
from s3server import ACCESS_KEY, make_s3_store

pytestmark = pytest.mark.s3


def test_wrong_secret_is_access_denied(s3_env, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    store = S3Store(s3_env.bucket, "p", endpoint_url=s3_env.endpoint, max_attempts=2)
    with pytest.raises(AccessDenied, match="credentials"):
        store.put("k", b"v")
    with pytest.raises(AccessDenied):
        store.check()


def test_missing_bucket(s3_env):
    store = S3Store("no-such-bucket-xyz", endpoint_url=s3_env.endpoint, max_attempts=2)
    with pytest.raises(BucketNotFound, match="no-such-bucket-xyz"):
        store.get("k")
    with pytest.raises(BucketNotFound):
        store.check()


def test_unreachable_endpoint_fails_in_bounded_time(s3_env):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    store = S3Store(
        "b",
        endpoint_url=f"http://127.0.0.1:{port}",
        connect_timeout=1,
        read_timeout=1,
        max_attempts=3,
    )
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="unreachable"):
        store.get("k")
    assert time.monotonic() - t0 < 30


def test_prefix_isolates_runs(s3_env):
    a = S3Store(s3_env.bucket, "run-a", endpoint_url=s3_env.endpoint)
    b = S3Store(s3_env.bucket, "run-b", endpoint_url=s3_env.endpoint)
    a.put("x", b"a")
    assert not b.exists("x")
    assert "x" in a.list()


def test_list_paginates(s3_env):
    store = make_s3_store(s3_env, list_page_size=7)
    keys = [f"p/{i:03d}" for i in range(30)]
    for k in keys:
        store.put(k, b"")
    assert store.list("p/") == keys
