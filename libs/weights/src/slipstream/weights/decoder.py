"""Decode one stored weight version (keyframe or delta) into tensors, bit for bit.

Shards must already be verified against their sha256 (chain.fetch_verified does that). A delta
is applied only onto the base it was made from: the caller's base version number must match
the manifest's base_version, and the base's content fingerprint must match the one the encoder
recorded; otherwise BaseMismatch is raised and the base is left as it was. When the output
shares no memory with the base, the base's fingerprint is taken while the first frames
decompress (the output is then garbage after a BaseMismatch); decoding into the base itself
checks first and writes nothing on a mismatch. After decoding, the result's fingerprint is
checked against the recorded one.

Frames are decompressed on one thread per core (workers.run_each, as in encoding). Each frame
lands straight in its output tensor: XORed with the base for 'xor', copied for 'full'; 'sparse'
payloads are gathered and scattered onto a copy of the base when their last frame lands. The
thread that finishes a tensor also takes its share of the result's fingerprint, so that this
GIL-bound work runs while other threads are inside zstd. Outputs are new tensors
carved from one buffer (like tensors loaded from one mapped file: safetensors' save_file
refuses them as shared; clone to separate) unless `out` names tensors to write into; `out` may
be the base itself (decode in place: no second copy of the model, but a failure midway leaves
it unusable).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch
import zstandard

from slipstream.schemas import TensorEntry, WeightManifest
from slipstream.weights import workers
from slipstream.weights.container import CODEC, ShardFormatError, ShardTable, read_shard
from slipstream.weights.delta import bits, element_dtype, sparse_apply, writable_bits
from slipstream.weights.errors import WeightsError
from slipstream.weights.fingerprint import combine
from slipstream.weights.fingerprint import part as fingerprint_part
from slipstream.weights.parts import split_parts
from slipstream.weights.snapshot import decode_snapshot
from slipstream.weights.tensors import dtype_from_name, shares_memory

ENCODINGS = ("full", "xor", "sparse")


class BaseMismatch(WeightsError):
    """A delta offered a base other than the one it was encoded against; nothing was applied."""


@dataclass
class _Target:
    entry: TensorEntry
    out: np.ndarray  # uint8 view of the output tensor
    base: np.ndarray | None  # uint8 view of the base tensor (xor/sparse)
    payload: np.ndarray | None = None  # gathered sparse payload
    frames_left: int = 0  # frames still to land in it (or in its payload)

    @property
    def elements(self) -> np.ndarray:
        return _elements(self.entry, self.out)


_ALIGN = 64


def _alloc(entries: Sequence[TensorEntry]) -> dict[str, torch.Tensor]:
    """Fresh output tensors for `entries`, carved from one buffer.

    One large numpy allocation gets transparent huge pages (numpy advises them from 4 MiB), so
    first-touching it costs about a third of what separate per-tensor allocations cost: decode
    writes every output byte once, so this is most of the difference at high compression.
    """
    offsets = []
    total = 0
    for e in entries:
        offsets.append(total)
        total += -(-_full_nbytes(e) // _ALIGN) * _ALIGN
    buf = np.empty(total, np.uint8)
    out: dict[str, torch.Tensor] = {}
    for e, o in zip(entries, offsets, strict=True):
        n = _full_nbytes(e)
        if n == 0:  # an empty slice cannot be viewed as a wider dtype
            out[e.name] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
        else:
            out[e.name] = torch.from_numpy(buf[o : o + n]).view(dtype_from_name(e.dtype)).reshape(e.shape)
    return out


def fits_entry(t: torch.Tensor, e: TensorEntry) -> bool:
    """Whether `t` has the dtype and shape the manifest's entry `e` describes."""
    return str(t.dtype).removeprefix("torch.") == e.dtype and list(t.shape) == list(e.shape)


def _full_nbytes(entry: TensorEntry) -> int:
    n = 1
    for d in entry.shape:
        n *= d
    return n * dtype_from_name(entry.dtype).itemsize


def _check_entries(manifest: WeightManifest, tables: list[ShardTable]) -> None:
    seen: set[str] = set()
    for e in manifest.tensors:
        where = f"version {manifest.policy_version} tensor {e.name!r}"
        if e.name in seen:
            raise ShardFormatError(f"{where} is listed twice")
        seen.add(e.name)
        if e.encoding not in ENCODINGS:
            raise ShardFormatError(f"{where}: unknown encoding {e.encoding!r} (known: {', '.join(ENCODINGS)})")
        if not 0 <= e.shard < len(tables):
            raise ShardFormatError(f"{where}: shard {e.shard} does not exist ({len(tables)} shards)")
        if e.offset < 0 or e.nbytes < 0 or e.offset + e.nbytes > tables[e.shard].raw_size:
            raise ShardFormatError(f"{where}: bytes [{e.offset}, {e.offset + e.nbytes}) lie outside its shard")
        full = _full_nbytes(e)
        if e.encoding != "sparse" and e.nbytes != full:
            raise ShardFormatError(f"{where}: {e.nbytes} bytes stored, {e.dtype}{e.shape} needs {full}")
        per = 4 + element_dtype(dtype_from_name(e.dtype).itemsize).itemsize
        if e.encoding == "sparse" and e.nbytes % per:
            raise ShardFormatError(f"{where}: sparse payload of {e.nbytes} bytes is not whole {per}-byte entries")


def _check_base(manifest: WeightManifest, base: Mapping[str, torch.Tensor], base_version: int | None) -> None:
    v = manifest.policy_version
    if base_version is not None and base_version != manifest.base_version:
        raise BaseMismatch(
            f"version {v} is a delta on version {manifest.base_version}, the base given is {base_version}"
        )
    for e in manifest.tensors:
        if e.encoding == "full":
            continue
        b = base.get(e.name)
        if b is None:
            raise BaseMismatch(f"version {v}: tensor {e.name!r} is a delta but the base has no such tensor")
        if not fits_entry(b, e):
            raise BaseMismatch(
                f"version {v}: base tensor {e.name!r} is {b.dtype}{tuple(b.shape)}, the delta needs {e.dtype}{e.shape}"
            )


def _elements(e: TensorEntry, b: np.ndarray) -> np.ndarray:
    """A tensor's bytes as unsigned integers of its element size (what sparse payloads address)."""
    return b.view(element_dtype(dtype_from_name(e.dtype).itemsize))


def _part(e: TensorEntry, b: np.ndarray) -> bytes:
    """`e`'s share of the fingerprint, from its bytes `b`."""
    return fingerprint_part(e.name, e.dtype, e.shape, _elements(e, b))


def decode_version(
    manifest: WeightManifest,
    shards: Sequence[bytes],
    base: Mapping[str, torch.Tensor] | None = None,
    *,
    base_version: int | None = None,
    out: MutableMapping[str, torch.Tensor] | None = None,
    threads: int = 0,
) -> dict[str, torch.Tensor]:
    """Tensors of `manifest`'s version from its verified shard bytes (in manifest order).

    `base` (and optionally the `base_version` it holds) is required for a delta. Raises
    BaseMismatch for the wrong base, ShardFormatError for bytes this codec did not write and
    WeightsError when the result does not match its recorded fingerprint.
    """
    if len(shards) != len(manifest.shards):
        raise WeightsError(
            f"version {manifest.policy_version}: {len(shards)} shards given, manifest lists {len(manifest.shards)}"
        )
    if manifest.parts:
        return _decode_parts(manifest, shards, base, base_version=base_version, out=out, threads=threads)
    codecs = {s.codec for s in manifest.shards}
    if codecs == {"raw"} or not manifest.shards:
        decoded = decode_snapshot(manifest, list(shards))  # a full snapshot from publish_snapshot
        if out is None:
            return decoded
        for name, t in decoded.items():
            if name in out:
                out[name].copy_(t)
            else:
                out[name] = t
        return {name: out[name] for name in decoded}
    if codecs != {CODEC}:
        raise ShardFormatError(f"version {manifest.policy_version}: shard codecs {sorted(codecs)}, expected {CODEC!r}")
    tables = [read_shard(d, ref.key) for d, ref in zip(shards, manifest.shards, strict=True)]
    fp = tables[0].fingerprint
    if any(t.fingerprint != fp or t.base_fingerprint != tables[0].base_fingerprint for t in tables):
        raise ShardFormatError(f"version {manifest.policy_version}: shards disagree on the version's fingerprint")
    _check_entries(manifest, tables)

    base_arrays: dict[str, np.ndarray] = {}
    if not manifest.keyframe:
        if base is None:
            raise BaseMismatch(
                f"version {manifest.policy_version} is a delta on version {manifest.base_version}: a base is needed"
            )
        _check_base(manifest, base, base_version)
        base_arrays = {e.name: bits(base[e.name]).view(np.uint8) for e in manifest.tensors if e.encoding != "full"}

    def check_base() -> None:
        based = [e for e in manifest.tensors if e.name in base_arrays]
        if combine({e.name: _part(e, base_arrays[e.name]) for e in based}) != tables[0].base_fingerprint:
            raise BaseMismatch(
                f"version {manifest.policy_version}: the base's content is not version {manifest.base_version} "
                "(fingerprint differs)"
            )

    given = out if out is not None else {}
    side = []
    if not manifest.keyframe:
        if base is not None and given and shares_memory(given.values(), base.values()):
            check_base()  # decoding writes into the base: nothing may be written before the check
        else:
            side.append(check_base)  # runs while other threads decompress; the base is only read

    result: dict[str, torch.Tensor] = {}
    targets: list[_Target] = []
    fresh = _alloc([e for e in manifest.tensors if e.name not in given])
    for e in manifest.tensors:
        t = given[e.name] if e.name in given else fresh[e.name]
        if not fits_entry(t, e):
            raise ValueError(f"out tensor {e.name!r} is {t.dtype}{tuple(t.shape)}, version needs {e.dtype}{e.shape}")
        result[e.name] = t
        targets.append(_Target(e, writable_bits(t, e.name).view(np.uint8), base_arrays.get(e.name)))
        if e.encoding == "sparse":
            targets[-1].payload = np.empty(e.nbytes, np.uint8)

    parts = _run_frames(manifest, tables, targets, side, threads)
    if combine(parts) != fp:
        raise WeightsError(f"version {manifest.policy_version} decoded to content that does not match its fingerprint")
    if out is not None:
        out.update(result)
    return result


def _decode_parts(
    manifest: WeightManifest,
    shards: Sequence[bytes],
    base: Mapping[str, torch.Tensor] | None,
    *,
    base_version: int | None,
    out: MutableMapping[str, torch.Tensor] | None,
    threads: int,
) -> dict[str, torch.Tensor]:
    """A version published per rank: each part decoded on its own (its own fingerprints), into one result.

    Decoding in place into the base, every delta part's base is checked before any part is written,
    so a BaseMismatch still leaves the base as it was."""
    split = split_parts(manifest)
    if base is not None and out is not None and shares_memory(out.values(), base.values()):
        for part, (sub, sl) in zip(manifest.parts, split, strict=True):
            if not sub.keyframe:
                _check_base(sub, base, base_version)
                table = read_shard(shards[sl][0], sub.shards[0].key)
                based = {
                    e.name: _part(e, bits(base[e.name]).view(np.uint8)) for e in sub.tensors if e.encoding != "full"
                }
                if combine(based) != table.base_fingerprint:
                    raise BaseMismatch(
                        f"version {manifest.policy_version}: the base's content is not version "
                        f"{manifest.base_version} (the fingerprint of rank {part.rank}'s part differs)"
                    )
    result: dict[str, torch.Tensor] = {}
    for sub, sl in split:
        result.update(decode_version(sub, shards[sl], base, base_version=base_version, out=out, threads=threads))
    return result


def _scatter(t: _Target) -> None:
    assert t.base is not None and t.payload is not None
    if not np.may_share_memory(t.out, t.base):  # in place (out is the base): nothing to copy
        np.copyto(t.out, t.base)
    sparse_apply(t.elements, t.payload)


def _run_frames(
    manifest: WeightManifest,
    tables: list[ShardTable],
    targets: list[_Target],
    side: list[Callable[[], None]],
    threads: int,
) -> dict[str, bytes]:
    """Decompress every frame into its tensors, on `threads` threads beside the `side` tasks.

    A tensor is finished (a sparse one scattered onto its base) by whichever thread lands its
    last frame, and that thread also takes its fingerprint part: the GIL-bound work spreads
    over the threads while others are in zstd. Returns every tensor's fingerprint part.
    """
    by_shard: list[list[_Target]] = [[] for _ in tables]
    for t in sorted(targets, key=lambda t: t.entry.offset):
        if t.entry.nbytes:
            by_shard[t.entry.shard].append(t)
    ends = [[t.entry.offset + t.entry.nbytes for t in ts] for ts in by_shard]
    jobs = [(s, f) for s, tbl in enumerate(tables) for f in range(len(tbl.frames))]

    def overlapped(s: int, f: int) -> list[_Target]:
        tbl = tables[s]
        lo, hi = tbl.raw_offsets[f], tbl.raw_offsets[f] + tbl.raw_sizes[f]
        # The tensors this frame overlaps: from the first one ending after its start.
        k = bisect.bisect_right(ends[s], lo)
        hit = []
        while k < len(by_shard[s]) and by_shard[s][k].entry.offset < hi:
            hit.append(by_shard[s][k])
            k += 1
        return hit

    per_job = [overlapped(s, f) for s, f in jobs]
    for hit in per_job:
        for t in hit:
            t.frames_left += 1
    parts: dict[str, bytes] = {}
    lock = threading.Lock()

    def finish(t: _Target) -> None:
        if t.entry.encoding == "sparse":
            _scatter(t)
        parts[t.entry.name] = _part(t.entry, t.out)

    def run(j: int) -> None:
        s, f = jobs[j]
        tbl = tables[s]
        lo, size = tbl.raw_offsets[f], tbl.raw_sizes[f]
        raw = _decompress(workers.decompressor(), tbl.frames[f], size, manifest.shards[s].key, f)
        for t in per_job[j]:
            _apply(t, raw, lo)
            with lock:
                t.frames_left -= 1
                done = t.frames_left == 0
            if done:
                finish(t)

    # Tensors no frame lands in (empty, or sparse with nothing changed) are finished beside them.
    frameless = [t for t in targets if not t.frames_left]
    side = [*side, *(partial(finish, t) for t in frameless)]
    workers.run_each_beside([partial(run, j) for j in range(len(jobs))], side, threads)
    return parts


def _decompress(d: zstandard.ZstdDecompressor, frame: memoryview, size: int, key: str, index: int) -> np.ndarray:
    try:
        declared = zstandard.frame_content_size(frame)
        if declared != size:
            raise ShardFormatError(f"shard {key} frame {index}: holds {declared} bytes, the table says {size}")
        return np.frombuffer(d.decompress(frame), np.uint8)
    except zstandard.ZstdError as exc:
        raise ShardFormatError(f"shard {key} frame {index} is not a valid zstd frame: {exc}") from exc


def _apply(t: _Target, raw: np.ndarray, frame_lo: int) -> None:
    e = t.entry
    lo = max(frame_lo, e.offset)
    hi = min(frame_lo + raw.size, e.offset + e.nbytes)
    piece = raw[lo - frame_lo : hi - frame_lo]
    a, b = lo - e.offset, hi - e.offset
    if e.encoding == "full":
        t.out[a:b] = piece
    elif e.encoding == "xor":
        assert t.base is not None
        np.bitwise_xor(t.base[a:b], piece, out=t.out[a:b])
    else:
        assert t.payload is not None
        t.payload[a:b] = piece
