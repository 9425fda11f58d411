"""Any S3-compatible service as an object store: AWS S3, Cloudflare R2, MinIO,
SeaweedFS.

Every call has a connect and a read timeout; botocore's "standard" retry mode
retries 5xx, throttling and connection errors with exponential backoff, a
bounded number of times (with the defaults, an unreachable endpoint fails in
well under 30 s). Whatever is left after the retries is mapped to one typed
error naming the store and key. `put_if_absent` is a conditional PUT
(`If-None-Match: *`), which S3, R2, MinIO and SeaweedFS all enforce.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import boto3
import botocore.exceptions as bexc
from botocore.config import Config

from .base import ObjectStore, check_key, check_prefix
from .errors import AccessDenied, BucketNotFound, NotFound, StoreError, StoreUnavailable

T = TypeVar("T")
_DENIED = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403", "Forbidden"}
_MISSING_KEY = {"NoSuchKey", "404", "NotFound"}
_TRANSPORT = (
    bexc.EndpointConnectionError,
    bexc.ConnectTimeoutError,
    bexc.ReadTimeoutError,
    bexc.ConnectionClosedError,
    bexc.ResponseStreamingError,
)


class S3Store(ObjectStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        endpoint_url: str | None = None,
        region: str | None = None,
        connect_timeout: float = 5,
        read_timeout: float = 30,
        max_attempts: int = 5,
        list_page_size: int = 1000,
        **kw: int,
    ) -> None:
        super().__init__(**kw)
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.endpoint_url, self.list_page_size = endpoint_url, list_page_size
        config = Config(
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retries={"max_attempts": max_attempts, "mode": "standard"},
            signature_version="s3v4",
            # Local servers (MinIO, SeaweedFS) have no per-bucket DNS names.
            s3={"addressing_style": "path"} if endpoint_url else {},
        )
        self.client = boto3.session.Session().client(
            "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=config
        )

    @property
    def url(self) -> str:
        where = f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"{where} ({self.endpoint_url})" if self.endpoint_url else where

    def _k(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        try:
            return fn()
        except bexc.ClientError as e:
            raise self._map(e, what, key) from None
        except _TRANSPORT as e:
            raise StoreUnavailable(
                f"{self.url}: {what} {key}: unreachable after retries ({e})"
            ) from None
        except bexc.NoCredentialsError:
            raise AccessDenied(
                f"{self.url}: no credentials (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY "
                "or AWS_PROFILE)"
            ) from None

    def _map(self, e: bexc.ClientError, what: str, key: str) -> StoreError:
        code = str(e.response.get("Error", {}).get("Code", ""))
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        where = f"{self.url}: {what} {key}"
        if code == "NoSuchBucket":
            return BucketNotFound(f"{where}: bucket {self.bucket!r} does not exist")
        if code in _DENIED or status == 403:
            return AccessDenied(f"{where}: access denied ({code}): check the credentials")
        if code in _MISSING_KEY or status == 404:
            return NotFound(f"{where}: no such object")
        if status >= 500 or code in ("SlowDown", "Throttling", "RequestTimeout"):
            return StoreUnavailable(f"{where}: server error after retries ({code} {status})")
        return StoreError(f"{where}: {code or status}: {e}")

    def check(self) -> None:
        """Fail early and clearly if the bucket is missing or the credentials are wrong."""

        def head() -> None:
            try:
                self.client.head_bucket(Bucket=self.bucket)
            except bexc.ClientError as e:
                if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
                    msg = f"{self.url}: bucket {self.bucket!r} does not exist"
                    raise BucketNotFound(msg) from None
                raise

        self._call("check", "", head)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        k = self._k(key)
        for attempt in range(3):
            resp = self._call("get", key, lambda: self.client.get_object(Bucket=self.bucket, Key=k))
            self._check_size(key, int(resp["ContentLength"]), max_bytes)
            try:
                return resp["Body"].read()
            except _TRANSPORT as e:  # a body cut off mid-stream: fetch again
                if attempt == 2:
                    raise StoreUnavailable(
                        f"{self.url}: get {key}: body read failed ({e})"
                    ) from None
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")

    def put(self, key: str, data: bytes) -> None:
        self._check_put(key, data)
        k = self._k(key)
        self._call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=k, Body=data))

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._check_put(key, data)
        k = self._k(key)
        for attempt in range(5):
            try:
                self.client.put_object(Bucket=self.bucket, Key=k, Body=data, IfNoneMatch="*")
                return True
            except bexc.ClientError as e:
                status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if status == 412:
                    return False
                if status != 409:  # 409: a concurrent conditional write is in flight
                    raise self._map(e, "put_if_absent", key) from None
            except _TRANSPORT as e:
                raise StoreUnavailable(f"{self.url}: put_if_absent {key}: {e}") from None
            if self.exists(key):
                return False
            time.sleep(0.1 * 2**attempt)
        raise StoreUnavailable(f"{self.url}: put_if_absent {key}: kept conflicting")

    def size(self, key: str) -> int:
        k = self._k(key)
        resp: dict[str, Any] = self._call(
            "size", key, lambda: self.client.head_object(Bucket=self.bucket, Key=k)
        )
        return int(resp["ContentLength"])

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def pages() -> list[str]:
            pager = self.client.get_paginator("list_objects_v2")
            it = pager.paginate(
                Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self.list_page_size}
            )
            return [o["Key"][strip:] for page in it for o in page.get("Contents", [])]

        return sorted(self._call("list", prefix, pages))

    def delete(self, key: str) -> None:
        k = self._k(key)
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=k))
