"""What every backend shares about moving bytes: metering, byte views and bounded parallel batches.

`store/transfer/bytes` and `store/transfer/seconds` are recorded per completed transfer with
labels op=put|get and backend=local|s3, so a dashboard can tell a slow disk from a slow network.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TypeVar

from slipstream.store.key import check_key
from slipstream.store.protocol import Data
from slipstream.telemetry.metrics import counter, histogram

BYTES = counter("store/transfer/bytes", "Bytes moved to or from the object store, by op and backend.")
SECONDS = histogram("store/transfer/seconds", "Duration of one object-store transfer, by op and backend.")

T = TypeVar("T")
R = TypeVar("R")


@contextmanager
def metered(op: str, backend: str, nbytes: Callable[[], int]) -> Iterator[None]:
    """Time the enclosed transfer and, if it completes, count `nbytes()` bytes (read after it ends)."""
    t0 = time.perf_counter()
    yield
    SECONDS.observe(time.perf_counter() - t0, op=op, backend=backend)
    BYTES.add(nbytes(), op=op, backend=backend)


def byte_view(data: Data) -> memoryview:
    """A flat unsigned-byte view of `data`, so lengths are bytes even for typed buffers (e.g. numpy floats)."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"object data must be bytes, bytearray or memoryview, not {type(data).__name__}")
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("object data must be a C-contiguous buffer; copy it with bytes(...) first")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def run_parallel(fn: Callable[[T], R], items: Iterable[T], max_workers: int) -> list[R]:
    """Apply `fn` to every item on at most `max_workers` threads; results in input order, first error raised."""
    todo = list(items)
    if len(todo) <= 1:
        return [fn(x) for x in todo]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(todo)), thread_name_prefix="store") as pool:
        return list(pool.map(fn, todo))


class BatchTransfers:
    """`put_many` / `get_many` for any store that has thread-safe `put` and `get`."""

    max_concurrency: int

    def put(self, key: str, data: Data) -> None:
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        raise NotImplementedError

    def put_many(self, items: Mapping[str, Data]) -> None:
        # Check every key before moving any bytes, so a typo does not leave half a batch behind.
        for key in items:
            check_key(key)
        run_parallel(lambda kv: self.put(kv[0], kv[1]), items.items(), self.max_concurrency)

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        wanted = list(dict.fromkeys(keys))
        for key in wanted:
            check_key(key)
        return dict(zip(wanted, run_parallel(self.get, wanted, self.max_concurrency), strict=True))
