"""Any S3-compatible service as an object store: AWS S3, Cloudflare R2, MinIO,
SeaweedFS.

Every call has a connect and a read timeout; botocore's "standard" retry mode
retries 5xx, throttling and connection errors with exponential backoff, a
bounded number of times (with the defaults, an unreachable endpoint fails in
well under 30 s). Whatever is left after the retries is mapped to one typed
error naming the store and key. `put_if_absent` is a conditional PUT
(`If-None-Match: *`), which S3, R2, MinIO and SeaweedFS all enforce.

Objects from `multipart_bytes` up go through boto3's transfer manager:
multipart uploads (each part a request with the client's retries; a failed
upload is aborted) and ranged, concurrent downloads. A writer killed
mid-upload leaves an unfinished upload that no reader sees;
`clean_partial` aborts such uploads (a bucket lifecycle rule for
incomplete multipart uploads does the same for prefixes nobody cleans).
"""

from __future__ import annotations

import copy
import io
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import boto3
import boto3.exceptions
import botocore.exceptions as bexc
import s3transfer.exceptions
from boto3.s3.transfer import TransferConfig
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
# What the transfer manager raises once a part has used up its retries.
_TRANSFER = (boto3.exceptions.S3UploadFailedError, s3transfer.exceptions.RetriesExceededError)


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
        profile: str | None = None,
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
        # A named profile (~/.aws/credentials): a worker may hold one
        # credential for the run's bucket and another for its inbox.
        self.profile = profile
        self.client = boto3.session.Session(profile_name=profile).client(
            "s3", endpoint_url=endpoint_url, region_name=region or "us-east-1", config=config
        )
        self.transfer = TransferConfig(
            multipart_threshold=self.multipart_bytes,
            multipart_chunksize=self.multipart_bytes,
            max_concurrency=4,
        )

    def sub(self, prefix: str) -> S3Store:
        out = copy.copy(self)  # the same client and settings
        out.prefix = "/".join(p for p in (self.prefix, check_key(prefix.strip("/"))) if p)
        return out

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
        except _TRANSFER as e:
            if any(code in str(e) for code in _DENIED):
                raise AccessDenied(f"{self.url}: {what} {key}: access denied ({e})") from None
            raise StoreUnavailable(f"{self.url}: {what} {key}: transfer failed ({e})") from None
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
        if len(data) >= self.multipart_bytes:
            # BytesIO over bytes shares the buffer: no second copy.
            self._call(
                "put",
                key,
                lambda: self.client.upload_fileobj(
                    io.BytesIO(data), self.bucket, k, Config=self.transfer
                ),
            )
            return
        self._call("put", key, lambda: self.client.put_object(Bucket=self.bucket, Key=k, Body=data))

    def put_file(self, key: str, path: Path) -> None:
        k = self._k(key)
        self._call(
            "put_file",
            key,
            lambda: self.client.upload_file(str(path), self.bucket, k, Config=self.transfer),
        )

    def get_file(self, key: str, path: Path, *, max_bytes: int | None = None) -> int:
        size = self.size(key)
        self._check_size(key, size, max_bytes)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        k = self._k(key)
        # download_file writes a temp file beside `path` and renames it.
        self._call(
            "get_file",
            key,
            lambda: self.client.download_file(self.bucket, k, str(path), Config=self.transfer),
        )
        got = path.stat().st_size
        if got != size:  # replaced while we read it: never hand back a mix
            path.unlink(missing_ok=True)
            raise StoreUnavailable(f"{self.url}: get_file {key}: size changed during download")
        return got

    def clean_partial(self, prefix: str, before: float) -> int:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix

        def uploads() -> list[dict]:
            pager = self.client.get_paginator("list_multipart_uploads")
            pages = pager.paginate(Bucket=self.bucket, Prefix=full)
            return [u for page in pages for u in page.get("Uploads", [])]

        removed = 0
        for u in self._call("clean_partial", prefix, uploads):
            if u["Initiated"].timestamp() < before:
                self._call(
                    "abort_multipart_upload",
                    u["Key"],
                    lambda u=u: self.client.abort_multipart_upload(
                        Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]
                    ),
                )
                removed += 1
        return removed

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

    def list_times(self, prefix: str = "") -> dict[str, float]:
        check_prefix(prefix)
        full = f"{self.prefix}/{prefix}" if self.prefix else prefix
        strip = len(self.prefix) + 1 if self.prefix else 0

        def pages() -> dict[str, float]:
            pager = self.client.get_paginator("list_objects_v2")
            it = pager.paginate(
                Bucket=self.bucket, Prefix=full, PaginationConfig={"PageSize": self.list_page_size}
            )
            return {
                o["Key"][strip:]: o["LastModified"].timestamp()
                for page in it
                for o in page.get("Contents", [])
            }

        return self._call("list", prefix, pages)

    def delete(self, key: str) -> None:
        k = self._k(key)
        self._call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=k))

    def delete_many(self, keys: list[str]) -> None:
        """DeleteObjects, 1,000 keys a request; a key it could not delete is an error."""
        for i in range(0, len(keys), 1000):
            batch = [{"Key": self._k(k)} for k in keys[i : i + 1000]]

            def call(batch=batch):
                return self.client.delete_objects(
                    Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True}
                )

            errors = self._call("delete_many", keys[i], call).get("Errors", [])
            if errors:
                e = errors[0]
                code = str(e.get("Code", ""))
                error = AccessDenied if code in _DENIED else StoreError
                raise error(f"{self.url}: delete {e.get('Key')}: {code} {e.get('Message', '')}")
