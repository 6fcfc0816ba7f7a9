"""The threads that compress and decompress weight frames, with their per-thread zstd contexts.

zstandard and numpy release the GIL, so independent zstd frames encode and decode on several
cores from one Python process. A call starts one drain loop per thread (the caller runs one
itself) and the loops pull frame indices from a shared counter: one pool hand-off per thread
rather than per frame, and no thread idles while another still has a queue. Compressor and
decompressor objects are not thread-safe, so each thread keeps its own, together with a scratch
buffer that stays warm in its cache between frames.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import numpy as np
import zstandard

R = TypeVar("R")
S = TypeVar("S")

_POOL_LOCK = threading.Lock()
_POOL: ThreadPoolExecutor | None = None
_POOL_SIZE = 0


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.compressors: dict[int, zstandard.ZstdCompressor] = {}
        self.decompressor: zstandard.ZstdDecompressor | None = None
        self.scratch = np.empty(0, np.uint8)


_LOCAL = _ThreadState()


def resolve_threads(threads: int) -> int:
    """`threads` if positive, else one per CPU core."""
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 = one per CPU core), got {threads}")
    return threads or (os.cpu_count() or 1)


def compressor(level: int) -> zstandard.ZstdCompressor:
    """This thread's zstd compressor for `level` (frames carry their content size)."""
    c = _LOCAL.compressors.get(level)
    if c is None:
        c = _LOCAL.compressors[level] = zstandard.ZstdCompressor(level=level, write_content_size=True)
    return c


def decompressor() -> zstandard.ZstdDecompressor:
    d = _LOCAL.decompressor
    if d is None:
        d = _LOCAL.decompressor = zstandard.ZstdDecompressor()
    return d


def scratch(nbytes: int) -> np.ndarray:
    """This thread's reusable uint8 buffer of at least `nbytes` (contents undefined)."""
    if _LOCAL.scratch.nbytes < nbytes:
        _LOCAL.scratch = np.empty(nbytes, np.uint8)
    return _LOCAL.scratch[:nbytes]


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL, _POOL_SIZE
    with _POOL_LOCK:
        if _POOL is None or workers > _POOL_SIZE:
            # Never shut the old pool down here: another caller may still be waiting on it.
            _POOL = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slipstream-weights")
            _POOL_SIZE = workers
        return _POOL


def run_each(fn: Callable[[int], R], n: int, threads: int) -> list[R]:
    """[fn(0), ..., fn(n-1)], computed by up to `threads` threads (the caller is one of them).

    Threads take the next index from a shared counter, so a thread that the OS descheduled (other
    processes share the cores) holds up one item, not a fixed half of the work. The first error
    is raised after every thread has stopped.
    """
    if n <= 0:
        return []
    workers = min(resolve_threads(threads), n)
    results: list[R | None] = [None] * n
    counter = itertools.count()  # next() on it is atomic under the GIL
    failed = threading.Event()

    def drain() -> None:
        while not failed.is_set():
            i = next(counter)
            if i >= n:
                return
            try:
                results[i] = fn(i)
            except BaseException:
                failed.set()
                raise

    if workers == 1:
        drain()
        return results  # type: ignore[return-value]
    futures = [_pool(workers - 1).submit(drain) for _ in range(workers - 1)]
    try:
        drain()
    finally:
        # Even when this thread failed, wait for the others: they may still write into buffers
        # the caller is about to drop or reuse.
        wait(futures)
    for f in futures:
        f.result()
    return results  # type: ignore[return-value]


def run_each_beside(
    main: Sequence[Callable[[], R]], side: Sequence[Callable[[], S]], threads: int
) -> tuple[list[R], list[S]]:
    """The results of `main` and of `side` tasks, side task k queued right behind main task k.

    For GIL-bound side work (hashing a few samples, bookkeeping): queued among the first main
    tasks, it runs on one thread while the others are in GIL-releasing code, not before them.
    """
    main_out: list[R | None] = [None] * len(main)
    side_out: list[S | None] = [None] * len(side)

    def run_main(k: int) -> None:
        main_out[k] = main[k]()

    def run_side(k: int) -> None:
        side_out[k] = side[k]()

    order = [
        (run, k)
        for k in range(max(len(main), len(side)))
        for run, n in ((run_main, len(main)), (run_side, len(side)))
        if k < n
    ]
    run_each(lambda i: order[i][0](order[i][1]), len(order), threads)
    return main_out, side_out  # type: ignore[return-value]
