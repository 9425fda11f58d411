"""The object-store interface every role talks to, and key validation.

Objects are immutable once published; readers never see a partial object;
`put_if_absent` is the one atomic primitive the protocol builds on (a version
is visible only once its marker is written with it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from .errors import InvalidKey, ObjectTooLarge

DEFAULT_MAX_BYTES = 8 << 30
MAX_KEY_BYTES = 1024
# Objects from this size up go as multipart uploads and ranged downloads (S3)
# or streamed copies (local): S3 refuses a single PUT over 5 GiB, and a
# checkpoint or anchor must not need to fit in memory twice.
DEFAULT_MULTIPART_BYTES = 64 << 20
MIN_PART_BYTES = 5 << 20  # S3's smallest part but the last


def check_key(key: str) -> str:
    """The key itself if it is a clean relative path, else InvalidKey."""
    if not isinstance(key, str) or not key:
        raise InvalidKey(f"invalid key {key!r}: empty")
    if len(key.encode()) > MAX_KEY_BYTES:
        raise InvalidKey(f"invalid key {key[:40]!r}…: longer than {MAX_KEY_BYTES} bytes")
    if "\\" in key or "\0" in key:
        raise InvalidKey(f"invalid key {key!r}: backslash or NUL")
    if key.startswith("/"):
        raise InvalidKey(f"invalid key {key!r}: absolute")
    if any(part in ("", ".", "..") for part in key.split("/")):
        raise InvalidKey(f"invalid key {key!r}: empty, '.' or '..' segment")
    return key


def check_prefix(prefix: str) -> str:
    """A list prefix: empty, or a key-like string (it may end with '/')."""
    if prefix:
        check_key(prefix.rstrip("/") or "x/")
    return prefix


class ObjectStore(ABC):
    """get / put / put_if_absent / exists / size / list / delete, size-bounded."""

    def __init__(
        self,
        *,
        max_put_bytes: int = DEFAULT_MAX_BYTES,
        multipart_bytes: int = DEFAULT_MULTIPART_BYTES,
    ) -> None:
        if multipart_bytes < MIN_PART_BYTES:
            raise ValueError(f"multipart_bytes must be >= {MIN_PART_BYTES} (S3's smallest part)")
        self.max_put_bytes, self.multipart_bytes = max_put_bytes, multipart_bytes

    @property
    @abstractmethod
    def url(self) -> str: ...

    @abstractmethod
    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        """The object's bytes; NotFound, or ObjectTooLarge above max_bytes."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write atomically, replacing any object under the key."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes) -> bool:
        """Write only if nothing is there; True iff this call wrote."""

    @abstractmethod
    def size(self, key: str) -> int:
        """The object's size in bytes; NotFound if missing."""

    @abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """All keys that start with prefix, sorted."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; no error if it is missing."""

    @abstractmethod
    def list_times(self, prefix: str = "") -> dict[str, float]:
        """{key: last-modified time, epoch seconds} for keys under prefix: one
        listing, where reading each object would be a request apiece."""

    def delete_many(self, keys: list[str]) -> None:
        """Remove these objects (missing ones are fine), in order."""
        for key in keys:
            self.delete(key)

    @abstractmethod
    def put_file(self, key: str, path: Path) -> None:
        """Upload a file of any size, streamed (multipart above `multipart_bytes`).

        For the trainer's own large objects (checkpoint shards, anchors): no
        `max_put_bytes` cap, and the object is visible only once complete.
        """

    @abstractmethod
    def get_file(self, key: str, path: Path, *, max_bytes: int | None = None) -> int:
        """Download to `path` (a temp file beside it, then a rename), streamed or
        in ranged GETs; the bytes written. NotFound; ObjectTooLarge above max_bytes."""

    @abstractmethod
    def clean_partial(self, prefix: str, before: float) -> int:
        """Remove unfinished uploads under `prefix` begun before `before` (epoch
        seconds), which a killed writer leaves behind unseen; how many."""

    def sub(self, prefix: str) -> ObjectStore:
        """The same store under `prefix` (a folder of this one): the inbox
        when it has no bucket of its own."""
        raise NotImplementedError(f"{type(self).__name__} has no sub-stores")

    def exists(self, key: str) -> bool:
        from .errors import NotFound

        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def _check_put(self, key: str, data: bytes) -> None:
        check_key(key)
        if len(data) > self.max_put_bytes:
            raise ObjectTooLarge(
                f"{self.url}: {key}: {len(data)} bytes exceeds the {self.max_put_bytes}-byte limit"
            )

    def _check_size(self, key: str, size: int, max_bytes: int | None) -> None:
        limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        if size > limit:
            raise ObjectTooLarge(f"{self.url}: {key}: {size} bytes exceeds the {limit}-byte limit")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.url!r})"
