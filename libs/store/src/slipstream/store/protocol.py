"""The object-store boundary: one small synchronous Protocol every backend implements.

Services keep large bytes (weight shards, long observations) here and pass keys over the bus.
Methods are blocking and thread-safe; asyncio code calls them through `asyncio.to_thread`.
Backends: `LocalObjectStore` (a directory) and `S3ObjectStore` (boto3), chosen by
`StoreConfig.type` through `setup_store`.
"""

from __future__ import annotations

import builtins
import os
from collections.abc import Iterable, Mapping
from typing import Protocol, runtime_checkable

Data = bytes | bytearray | memoryview
StrPath = str | os.PathLike[str]


@runtime_checkable
class ObjectStore(Protocol):
    """Bytes under '/'-separated relative keys. Invalid keys raise ValueError naming the key."""

    def put(self, key: str, data: Data) -> None:
        """Store `data` under `key`, replacing any object there. Readers see the old or the new bytes, never a mix."""
        ...

    def put_file(self, key: str, path: StrPath) -> None:
        """Store the contents of the file at `path` under `key` (large files go in parallel parts)."""
        ...

    def put_if_absent(self, key: str, data: Data) -> bool:
        """Write-once: store `data` and return True only if `key` held no object; else leave it and return False.

        Atomic against concurrent writers: of N racing callers exactly one gets True. Use it for commit markers.
        """
        ...

    def get(self, key: str) -> bytes:
        """The object's bytes; ObjectNotFound (a KeyError) if there is none."""
        ...

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """Bytes [start, start+length) of the object, clipped at its end (b"" past the end)."""
        ...

    def get_file(self, key: str, path: StrPath) -> None:
        """Write the object to `path` (via a temp file and rename, so `path` is never partial)."""
        ...

    def exists(self, key: str) -> bool: ...

    def size(self, key: str) -> int:
        """The object's length in bytes; ObjectNotFound if there is none."""
        ...

    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""
        ...

    def list(self, prefix: str = "") -> builtins.list[str]:
        """Every key starting with `prefix` (a plain string prefix, not only whole segments), sorted."""
        ...

    def put_many(self, items: Mapping[str, Data]) -> None:
        """Store several objects in parallel (at most `max_concurrency` at a time)."""
        ...

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        """Fetch several objects in parallel; ObjectNotFound if any is missing."""
        ...

    def url(self, key: str) -> str:
        """Where the object lives (file:// or s3://), for logs and error messages."""
        ...

    def close(self) -> None: ...
