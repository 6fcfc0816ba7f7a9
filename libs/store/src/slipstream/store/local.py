"""The local-directory object store: one file per key under a root directory.

The default backend for development, tests and single-machine runs. Every write goes to a temp
file in the destination directory and becomes visible in one atomic step (`os.replace`, or
`os.link` for write-once), so a reader sees a whole old object or a whole new one, never a
partial file. Temp files carry a name prefix keys may not use, so `list` never reports them.
"""

from __future__ import annotations

import builtins
import errno
import os
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from slipstream.store.errors import ObjectNotFound
from slipstream.store.key import TEMP_PREFIX, check_key, check_prefix
from slipstream.store.protocol import Data, StrPath
from slipstream.store.transfer import BatchTransfers, byte_view, metered

_COPY_BUFFER = 4 * 1024 * 1024
# A concurrent delete may prune the directory a writer just created; the writer recreates it.
_MKDIR_ATTEMPTS = 5
_MISSING = (FileNotFoundError, NotADirectoryError, IsADirectoryError)
_NO_LINKS = frozenset({errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV})


class LocalObjectStore(BatchTransfers):
    backend = "local"

    def __init__(self, root: StrPath, *, fsync: bool = False, max_concurrency: int = 8) -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        self.root = Path(root).absolute()
        self.root.mkdir(parents=True, exist_ok=True)
        self.fsync = fsync
        self.max_concurrency = max_concurrency

    def __repr__(self) -> str:
        return f"LocalObjectStore({str(self.root)!r})"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    # -- writing -----------------------------------------------------------------------------

    def _open_temp(self, directory: Path) -> tuple[Path, BinaryIO]:
        for attempt in range(_MKDIR_ATTEMPTS):
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f"{TEMP_PREFIX}{uuid.uuid4().hex}"
            try:
                return tmp, open(tmp, "xb")  # _stage closes it
            except FileNotFoundError:
                if attempt == _MKDIR_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def _stage(self, dest: Path, write: Callable[[BinaryIO], object]) -> Path:
        """Write a complete temp file beside `dest` and return its path; nothing is visible yet."""
        tmp, f = self._open_temp(dest.parent)
        try:
            with f:
                write(f)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    def _publish(self, tmp: Path, dest: Path) -> None:
        try:
            os.replace(tmp, dest)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync_dir(dest.parent)

    def put(self, key: str, data: Data) -> None:
        dest = self._path(key)
        view = byte_view(data)
        with metered("put", self.backend, lambda: view.nbytes):
            self._publish(self._stage(dest, lambda f: f.write(view)), dest)

    def put_file(self, key: str, path: StrPath) -> None:
        dest = self._path(key)
        with open(path, "rb") as src, metered("put", self.backend, lambda: os.fstat(src.fileno()).st_size):
            self._publish(self._stage(dest, lambda f: shutil.copyfileobj(src, f, _COPY_BUFFER)), dest)

    def put_if_absent(self, key: str, data: Data) -> bool:
        dest = self._path(key)
        view = byte_view(data)
        with metered("put", self.backend, lambda: view.nbytes):
            tmp = self._stage(dest, lambda f: f.write(view))
            try:
                # link(2) creates the name only if it does not exist, in one step, with the full content.
                os.link(tmp, dest)
            except FileExistsError:
                if dest.is_dir():
                    raise IsADirectoryError(f"key {key!r} is a directory of other keys in {self.root}") from None
                return False
            except OSError as e:
                if e.errno not in _NO_LINKS:
                    raise
                # No fallback: O_EXCL would let readers see a half-written marker.
                raise OSError(
                    e.errno, f"put_if_absent({key!r}) needs hard links, which the filesystem under {self.root} refused"
                ) from e
            finally:
                tmp.unlink(missing_ok=True)
            if self.fsync:
                _fsync_dir(dest.parent)
            return True

    # -- reading -----------------------------------------------------------------------------

    def _open(self, key: str) -> BinaryIO:
        try:
            return open(self._path(key), "rb")
        except _MISSING:
            raise ObjectNotFound(key, str(self.root)) from None

    def get(self, key: str) -> bytes:
        out = b""
        with metered("get", self.backend, lambda: len(out)), self._open(key) as f:
            out = f.read()
        return out

    def get_range(self, key: str, start: int, length: int) -> bytes:
        if start < 0 or length < 0:
            raise ValueError(f"get_range({key!r}): start and length must be >= 0, got {start}, {length}")
        out = b""
        with metered("get", self.backend, lambda: len(out)), self._open(key) as f:
            f.seek(start)
            out = f.read(length)
        return out

    def get_file(self, key: str, path: StrPath) -> None:
        dest = Path(path)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex}.partial"
        with self._open(key) as src, metered("get", self.backend, lambda: os.fstat(src.fileno()).st_size):
            try:
                with open(tmp, "xb") as f:
                    shutil.copyfileobj(src, f, _COPY_BUFFER)
                os.replace(tmp, dest)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def size(self, key: str) -> int:
        try:
            st = os.stat(self._path(key))
        except _MISSING:
            raise ObjectNotFound(key, str(self.root)) from None
        if not stat.S_ISREG(st.st_mode):
            raise ObjectNotFound(key, str(self.root))
        return st.st_size

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            os.unlink(path)
        except _MISSING:
            return  # idempotent: nothing (or only a directory of other keys) is there
        # Drop directories the delete left empty, so old steps do not pile up as empty folders.
        d = path.parent
        while d != self.root:
            try:
                d.rmdir()
            except OSError:
                break  # not empty (other keys, or a writer's temp file): keep it and stop
            d = d.parent

    def list(self, prefix: str = "") -> builtins.list[str]:
        check_prefix(prefix)
        base_rel = prefix.rpartition("/")[0]
        base = self.root / base_rel if base_rel else self.root
        keys: builtins.list[str] = []
        for dirpath, dirnames, filenames in os.walk(base):
            rel_dir = Path(dirpath).relative_to(self.root).as_posix()
            lead = "" if rel_dir == "." else rel_dir + "/"
            # Only descend where a key could still start with the prefix.
            dirnames[:] = [
                d for d in dirnames if (lead + d + "/").startswith(prefix) or prefix.startswith(lead + d + "/")
            ]
            keys.extend(
                lead + name
                for name in filenames
                if not name.startswith(TEMP_PREFIX) and (lead + name).startswith(prefix)
            )
        return sorted(keys)

    def url(self, key: str) -> str:
        return self._path(key).as_uri()

    def close(self) -> None:
        """Nothing to release; here so every backend closes the same way."""


def _fsync_dir(directory: Path) -> None:
    # The rename is durable only once the directory entry itself is on disk.
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
