"""A directory as an object store, for runs on one machine.

Writes go to a temp file in the target's directory, are fsynced, then
renamed (put) or hard-linked (put_if_absent): both are atomic on POSIX
filesystems, so readers see the old object, the new one or nothing, and of
several processes racing on put_if_absent exactly one links its file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

from .base import ObjectStore, check_key, check_prefix
from .errors import NotFound, StoreError

TMP_PREFIX = ".tmp-"
CHUNK = 8 << 20


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike, **kw: int) -> None:
        super().__init__(**kw)
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _write_temp(self, path: Path, data: bytes | Path) -> str:
        """A fsynced temp file beside `path` holding `data` (bytes, or a file's
        contents copied in a stream)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                if isinstance(data, Path):
                    with data.open("rb") as src:
                        shutil.copyfileobj(src, f, CHUNK)
                else:
                    f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    @staticmethod
    def _fsync_dir(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                self._check_size(key, os.fstat(f.fileno()).st_size, max_bytes)
                return f.read()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{self.url}: no object {key}") from None

    def put(self, key: str, data: bytes) -> None:
        self._check_put(key, data)
        self._replace(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self._replace(key, Path(path))

    def _replace(self, key: str, data: bytes | Path) -> None:
        """Write `data` (bytes or a file's contents) under `key`, atomically."""
        target = self._path(key)
        tmp = self._write_temp(target, data)
        try:
            os.replace(tmp, target)
        except IsADirectoryError:
            Path(tmp).unlink(missing_ok=True)
            raise StoreError(f"{self.url}: {key} is a directory of other keys") from None
        self._fsync_dir(target.parent)

    def get_file(self, key: str, path: Path, *, max_bytes: int | None = None) -> int:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            with open(self._path(key), "rb") as src:
                size = os.fstat(src.fileno()).st_size
                self._check_size(key, size, max_bytes)
                fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
                try:
                    with os.fdopen(fd, "wb") as out:
                        shutil.copyfileobj(src, out, CHUNK)
                    os.replace(tmp, path)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise NotFound(f"{self.url}: no object {key}") from None
        return size

    def clean_partial(self, prefix: str, before: float) -> int:
        check_prefix(prefix)
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        removed = 0
        for dirpath, _dirs, files in os.walk(self.root / head if head else self.root):
            for name in files:
                p = Path(dirpath) / name
                rel = p.relative_to(self.root).as_posix()
                if name.startswith(TMP_PREFIX) and rel.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        if p.stat().st_mtime < before:
                            p.unlink()
                            removed += 1
        return removed

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._check_put(key, data)
        path = self._path(key)
        tmp = self._write_temp(path, data)
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
        finally:
            Path(tmp).unlink(missing_ok=True)
        self._fsync_dir(path.parent)
        return True

    def size(self, key: str) -> int:
        path = self._path(key)
        if not path.is_file():
            raise NotFound(f"{self.url}: no object {key}")
        return path.stat().st_size

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, not the whole tree.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / head if head else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(start):
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(TMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError):
            self._path(key).unlink()
