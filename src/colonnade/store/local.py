"""A directory as an object store, for runs on one machine.

Writes go to a temp file in the target's directory, are fsynced, then
renamed (put) or hard-linked (put_if_absent): both are atomic on POSIX
filesystems, so readers see the old object, the new one or nothing, and of
several processes racing on put_if_absent exactly one links its file.

Anyone who can write the directory can put things there that are not
objects: FIFOs (an `open` would wait for a writer forever), sockets,
devices, symlinks (to /dev/zero, or out of the store), files where a folder
should be. Reads open regular files only (`O_NOFOLLOW | O_NONBLOCK`, then
`fstat`) and read no more than the caller's bound, whatever the size says;
anything else is `InvalidObject`. Reads and writes happen only where the
real path of the key's folder lies inside the root (checked before each
one; a swap between the check and the write is not defended, see
docs/security.md).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from .base import DEFAULT_MAX_BYTES, ObjectStore, check_key, check_prefix
from .errors import InvalidObject, NotFound, ObjectTooLarge, StoreError

TMP_PREFIX = ".tmp-"
CHUNK = 8 << 20
_READ_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_READ_FLAGS |= getattr(os, "O_CLOEXEC", 0)


class LocalStore(ObjectStore):
    def __init__(self, root: str | os.PathLike, **kw: int) -> None:
        super().__init__(**kw)
        self.root = Path(root).expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def sub(self, prefix: str) -> LocalStore:
        return LocalStore(
            self.root / check_key(prefix.strip("/")),
            max_put_bytes=self.max_put_bytes,
            multipart_bytes=self.multipart_bytes,
        )

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def _inside(self, folder: Path, key: str) -> None:
        """InvalidObject unless `folder`'s real path lies inside the root."""
        real = os.path.realpath(folder)
        root = str(self.root)
        if real != root and not real.startswith(root + os.sep):
            raise InvalidObject(f"{self.url}: {key}: its folder leads out of the store")

    def _folder(self, path: Path, key: str) -> None:
        """Make the key's folder (inside the root) or say why it cannot be."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise StoreError(f"{self.url}: {key}: a file stands where its folder should") from None
        self._inside(path.parent, key)

    def _write_temp(self, path: Path, data: bytes | Path, key: str) -> str:
        """A fsynced temp file beside `path` holding `data` (bytes, or a file's
        contents copied in a stream)."""
        self._folder(path, key)
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

    def _open(self, key: str) -> tuple[int, int]:
        """(fd, size) of the regular file at `key`; NotFound or InvalidObject."""
        path = self._path(key)
        try:
            self._inside(path.parent, key)
            fd = os.open(path, _READ_FLAGS)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"{self.url}: no object {key}") from None
        except OSError as e:  # ELOOP (a symlink), ENXIO (a socket), EACCES …
            why = "a symlink" if e.errno == errno.ELOOP else e.strerror
            raise InvalidObject(f"{self.url}: {key} is not an object ({why})") from None
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode):
            return fd, os.fstat(fd).st_size
        os.close(fd)
        if stat.S_ISDIR(mode):
            raise NotFound(f"{self.url}: no object {key} (a folder of other keys)")
        raise InvalidObject(f"{self.url}: {key} is not an object (not a regular file)")

    def get(self, key: str, *, max_bytes: int | None = None) -> bytes:
        fd, size = self._open(key)
        limit = DEFAULT_MAX_BYTES if max_bytes is None else max_bytes
        with os.fdopen(fd, "rb") as f:
            self._check_size(key, size, limit)
            data = f.read(limit + 1)  # the size may lie (a file still growing)
        if len(data) > limit:
            raise ObjectTooLarge(f"{self.url}: {key}: more than the {limit}-byte limit")
        return data

    def put(self, key: str, data: bytes) -> None:
        self._check_put(key, data)
        self._replace(key, data)

    def put_file(self, key: str, path: Path) -> None:
        self._replace(key, Path(path))

    def _replace(self, key: str, data: bytes | Path) -> None:
        """Write `data` (bytes or a file's contents) under `key`, atomically."""
        target = self._path(key)
        tmp = self._write_temp(target, data, key)
        try:
            os.replace(tmp, target)
        except IsADirectoryError:
            Path(tmp).unlink(missing_ok=True)
            raise StoreError(f"{self.url}: {key} is a directory of other keys") from None
        self._fsync_dir(target.parent)

    def get_file(self, key: str, path: Path, *, max_bytes: int | None = None) -> int:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, size = self._open(key)
        with os.fdopen(fd, "rb") as src:
            self._check_size(key, size, max_bytes)
            out_fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TMP_PREFIX)
            try:
                with os.fdopen(out_fd, "wb") as out:
                    copied = 0
                    while chunk := src.read(min(CHUNK, size - copied + 1)):
                        copied += len(chunk)
                        if copied > size:
                            raise ObjectTooLarge(f"{self.url}: {key}: grew while it was read")
                        out.write(chunk)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
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
                        if p.lstat().st_mtime < before:
                            p.unlink()
                            removed += 1
        return removed

    def put_if_absent(self, key: str, data: bytes) -> bool:
        self._check_put(key, data)
        path = self._path(key)
        tmp = self._write_temp(path, data, key)
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
        try:
            self._inside(path.parent, key)
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError, InvalidObject):
            raise NotFound(f"{self.url}: no object {key}") from None
        if not stat.S_ISREG(st.st_mode):
            raise NotFound(f"{self.url}: no object {key} (not a regular file)")
        return st.st_size

    def list(self, prefix: str = "") -> list[str]:
        check_prefix(prefix)
        # Walk only the deepest directory the prefix names, not the whole tree.
        head = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        start = self.root / head if head else self.root
        keys = []
        for dirpath, _dirs, files in os.walk(start):  # symlinked folders are not entered
            rel = Path(dirpath).relative_to(self.root).as_posix()
            for name in files:
                if name.startswith(TMP_PREFIX):
                    continue
                key = name if rel == "." else f"{rel}/{name}"
                if key.startswith(prefix):
                    keys.append(key)
        return sorted(keys)

    def list_times(self, prefix: str = "") -> dict[str, float]:
        out = {}
        for key in self.list(prefix):
            with contextlib.suppress(FileNotFoundError):
                out[key] = os.lstat(self.root / key).st_mtime
        return out

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError, IsADirectoryError, NotADirectoryError):
            self._path(key).unlink()
