"""Encode one weight version into stored shards: a keyframe (every tensor in full) or a delta against its base.

Every tensor is cut into frames of at most `frame_bytes`; threads take frames one at a time
(workers.run_each), XOR each into their scratch buffer (still in their cache), count the
changed elements and compress it with zstd. A frame never spans two
tensors, so each tensor's compressed XOR size is known exactly; a tensor whose sparse payload
could be smaller (its raw size is under `SPARSE_FACTOR` times the compressed XOR, and zstd
shrinks sparse payloads by less than that on weight deltas) is sparse-encoded and compressed
too, and the smaller one is kept. Tensors then fill shards in order, each shard at most
`shard_bytes` of raw payload (a tensor never splits, so one bigger than that gets a shard of
its own).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from slipstream.schemas import TensorEntry
from slipstream.weights import workers
from slipstream.weights.container import pack_shard
from slipstream.weights.delta import MAX_SPARSE_ELEMENTS, bits, count_changed, sparse_encode, sparse_nbytes
from slipstream.weights.fingerprint import NO_FINGERPRINT, fingerprint_of
from slipstream.weights.snapshot import DEFAULT_SHARD_BYTES
from slipstream.weights.tensors import dtype_name

DEFAULT_FRAME_BYTES = 1 << 20  # fits a core's L2 with its XOR inputs: the XOR never leaves cache
DEFAULT_LEVEL = 1  # zstd-3 gains nothing on XOR deltas and encodes ~10 % slower (limits.md §4)
SPARSE_FACTOR = 2


@dataclass
class _Tensor:
    name: str
    dtype: str
    shape: list[int]
    new: np.ndarray
    base: np.ndarray | None
    encoding: str
    frames: list[bytes] = field(default_factory=list)
    raw_sizes: list[int] = field(default_factory=list)
    changed: int = 0

    @property
    def stored(self) -> int:
        return sum(len(f) for f in self.frames)

    @property
    def raw(self) -> int:
        return sum(self.raw_sizes)


@dataclass
class CodedVersion:
    """One encoded version, ready to store: shard bytes and where every tensor lives in them."""

    shards: list[bytes]
    tensors: list[TensorEntry]
    keyframe: bool
    raw_bytes: int  # the full snapshot's size, whatever was stored
    elements: int
    changed: int  # elements that differ from the base (every element for a keyframe)
    fingerprint: bytes
    base_fingerprint: bytes
    seconds: float

    @property
    def stored_bytes(self) -> int:
        return sum(len(s) for s in self.shards)

    @property
    def ratio(self) -> float:
        """Raw snapshot bytes per stored byte."""
        return self.raw_bytes / max(1, self.stored_bytes)


def delta_mismatch(tensors: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor]) -> str | None:
    """Why `tensors` cannot be encoded against `base` (names, dtypes or shapes differ), or None."""
    missing = sorted(set(tensors) - set(base))
    if missing:
        return f"tensor {missing[0]!r} is not in the base"
    extra = sorted(set(base) - set(tensors))
    if extra:
        return f"base tensor {extra[0]!r} is not in the new version"
    for name, t in tensors.items():
        b = base[name]
        if t.dtype != b.dtype or tuple(t.shape) != tuple(b.shape):
            return f"tensor {name!r} is {t.dtype}{tuple(t.shape)}, its base {b.dtype}{tuple(b.shape)}"
    return None


def _check(level: int, frame_bytes: int, shard_bytes: int) -> None:
    if not 1 <= level <= 22:
        raise ValueError(f"zstd level must be in 1..22, got {level}")
    if frame_bytes < 4096 or frame_bytes % 8:
        raise ValueError(f"frame_bytes must be a multiple of 8 and >= 4096, got {frame_bytes}")
    if shard_bytes < 1:
        raise ValueError(f"shard_bytes must be >= 1, got {shard_bytes}")


def _frame_jobs(items: list[_Tensor], frame_bytes: int) -> list[tuple[int, int, int]]:
    jobs: list[tuple[int, int, int]] = []
    for i, t in enumerate(items):
        step = max(1, frame_bytes // t.new.itemsize)
        jobs.extend((i, a, min(a + step, t.new.size)) for a in range(0, t.new.size, step))
    return jobs


def _fingerprint(items: list[_Tensor], *, base: bool) -> bytes:
    if base:
        return fingerprint_of({t.name: (t.dtype, tuple(t.shape), t.base) for t in items if t.base is not None})
    return fingerprint_of({t.name: (t.dtype, tuple(t.shape), t.new) for t in items})


def _encode_frame(items: list[_Tensor], job: tuple[int, int, int], level: int) -> tuple[bytes, int]:
    """One frame compressed, and how many of its elements changed."""
    i, a, b = job
    t = items[i]
    c = workers.compressor(level)
    if t.base is None:
        return c.compress(t.new[a:b].data), b - a
    s = workers.scratch((b - a) * t.new.itemsize).view(t.new.dtype)
    np.bitwise_xor(t.base[a:b], t.new[a:b], out=s)
    return c.compress(s.data), count_changed(s)


def _compress_payload(payload: memoryview, frame_bytes: int, level: int) -> tuple[list[bytes], list[int]]:
    c = workers.compressor(level)
    cuts = range(0, len(payload), frame_bytes)
    return [c.compress(payload[a : a + frame_bytes]) for a in cuts], [min(frame_bytes, len(payload) - a) for a in cuts]


def _try_sparse(t: _Tensor, frame_bytes: int, level: int) -> None:
    assert t.base is not None
    payload = memoryview(sparse_encode(t.base, t.new))
    frames, sizes = _compress_payload(payload, frame_bytes, level)
    if sum(len(f) for f in frames) < t.stored:
        t.frames, t.raw_sizes, t.encoding = frames, sizes, "sparse"


def encode_version(
    tensors: Mapping[str, torch.Tensor],
    base: Mapping[str, torch.Tensor] | None = None,
    *,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    sparse: bool = True,
) -> CodedVersion:
    """A keyframe of `tensors` (base None) or their lossless delta against `base`.

    `threads` 0 means one per core. Raises ValueError if the base does not hold the same tensor
    names, dtypes and shapes (encode a keyframe then) or an option is out of range.
    """
    _check(level, frame_bytes, shard_bytes)
    if not tensors:
        raise ValueError("encode_version: no tensors given")
    t0 = time.perf_counter()
    if base is not None:
        reason = delta_mismatch(tensors, base)
        if reason:
            raise ValueError(f"cannot encode a delta: {reason}")
    items = [
        _Tensor(
            name=name,
            dtype=dtype_name(t.dtype),
            shape=list(t.shape),
            new=bits(t),
            base=None if base is None else bits(base[name]),
            encoding="full" if base is None else "xor",
        )
        for name, t in tensors.items()
    ]
    jobs = _frame_jobs(items, frame_bytes)
    # Fingerprinting is GIL-bound Python: as side tasks it runs while the other thread is inside
    # zstd (which releases the GIL) instead of before or after the parallel part.
    fingerprints = [partial(_fingerprint, items, base=False)]
    if base is not None:
        fingerprints.append(partial(_fingerprint, items, base=True))
    results, (fp, *base_fps) = workers.run_each_beside(
        [partial(_encode_frame, items, job, level) for job in jobs], fingerprints, threads
    )
    base_fp = base_fps[0] if base_fps else NO_FINGERPRINT
    for (i, a, b), (frame, changed) in zip(jobs, results, strict=True):
        t = items[i]
        t.frames.append(frame)
        t.raw_sizes.append((b - a) * t.new.itemsize)
        t.changed += changed
    if base is not None and sparse:
        _choose_sparse(items, frame_bytes, level, threads)

    shards, entries = _fill_shards(items, shard_bytes)
    packed = [pack_shard(fr, rs, fingerprint=fp, base_fingerprint=base_fp) for fr, rs in shards]
    elements = sum(t.new.size for t in items)
    return CodedVersion(
        shards=packed,
        tensors=entries,
        keyframe=base is None,
        raw_bytes=sum(t.new.nbytes for t in items),
        elements=elements,
        changed=elements if base is None else sum(t.changed for t in items),
        fingerprint=fp,
        base_fingerprint=base_fp,
        seconds=time.perf_counter() - t0,
    )


def _choose_sparse(items: list[_Tensor], frame_bytes: int, level: int, threads: int) -> None:
    candidates = []
    for t in items:
        if t.new.size > MAX_SPARSE_ELEMENTS:
            continue
        if t.changed == 0:
            # Nothing changed: an empty sparse payload says so in zero bytes.
            t.frames, t.raw_sizes, t.encoding = [], [], "sparse"
        elif sparse_nbytes(t.changed, t.new.itemsize) < SPARSE_FACTOR * t.stored:
            candidates.append(t)
    workers.run_each(lambda i: _try_sparse(candidates[i], frame_bytes, level), len(candidates), threads)


def _fill_shards(
    items: list[_Tensor], shard_bytes: int
) -> tuple[list[tuple[list[bytes], list[int]]], list[TensorEntry]]:
    shards: list[tuple[list[bytes], list[int]]] = []
    entries: list[TensorEntry] = []
    size = 0
    for t in items:
        if not shards or (size and size + t.raw > shard_bytes):
            shards.append(([], []))
            size = 0
        frames, raw_sizes = shards[-1]
        entries.append(
            TensorEntry(
                name=t.name,
                dtype=t.dtype,
                shape=t.shape,
                shard=len(shards) - 1,
                offset=size,
                nbytes=t.raw,
                encoding=t.encoding,
            )
        )
        frames.extend(t.frames)
        raw_sizes.extend(t.raw_sizes)
        size += t.raw
    return shards, entries
