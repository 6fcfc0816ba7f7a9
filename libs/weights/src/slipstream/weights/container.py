"""The stored shard format (ShardRef.codec 'zstd'): a frame table, then independent zstd frames.

    shard  := table-frame  zstd-frame*
    table  := zstd skippable frame (magic 0x184D2A5E, u32 length) holding
              b"SLIPSHRD" u32 format u32 n  fingerprint[32]  base_fingerprint[32]
              u64 raw_size[n]  u64 stored_size[n]

Independent frames are what lets several threads compress and decompress one shard, and the
table says where each starts without scanning. The table is a skippable frame, so a shard is
still a valid zstd stream: `zstd -d` turns it into the shard's raw payload (the frames'
contents back to back, in which TensorEntry.offset/nbytes point). The fingerprints (see
fingerprint.py) name the content this version decodes to and the base it must be applied onto.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from slipstream.weights.errors import WeightsError
from slipstream.weights.fingerprint import FINGERPRINT_BYTES

SKIPPABLE_MAGIC = 0x184D2A5E
TAG = b"SLIPSHRD"
FORMAT = 1
CODEC = "zstd"
_FRAME_HEAD = struct.Struct("<II")  # magic, payload length
_TABLE_HEAD = struct.Struct(f"<8sII{FINGERPRINT_BYTES}s{FINGERPRINT_BYTES}s")
_SIZES = np.dtype("<u8")


class ShardFormatError(WeightsError):
    """Stored bytes that are not a shard this codec wrote (or a newer format)."""


@dataclass(frozen=True)
class ShardTable:
    """A parsed shard: its frames (views into the stored bytes) and where each lands in the raw payload."""

    frames: list[memoryview]
    raw_offsets: list[int]
    raw_sizes: list[int]
    raw_size: int
    fingerprint: bytes
    base_fingerprint: bytes


def pack_shard(
    frames: Sequence[bytes], raw_sizes: Sequence[int], *, fingerprint: bytes, base_fingerprint: bytes
) -> bytes:
    """Join compressed frames behind their table into one storable shard."""
    if len(frames) != len(raw_sizes):
        raise ValueError(f"pack_shard: {len(frames)} frames but {len(raw_sizes)} raw sizes")
    if len(fingerprint) != FINGERPRINT_BYTES or len(base_fingerprint) != FINGERPRINT_BYTES:
        raise ValueError(f"pack_shard: fingerprints must be {FINGERPRINT_BYTES} bytes")
    sizes = np.empty(2 * len(frames), _SIZES)
    sizes[: len(frames)] = raw_sizes
    sizes[len(frames) :] = [len(f) for f in frames]
    table = _TABLE_HEAD.pack(TAG, FORMAT, len(frames), fingerprint, base_fingerprint) + sizes.tobytes()
    return b"".join([_FRAME_HEAD.pack(SKIPPABLE_MAGIC, len(table)), table, *frames])


def read_shard(data: bytes | bytearray | memoryview, key: str = "<shard>") -> ShardTable:
    """Parse a shard's table and slice out its frames; ShardFormatError names what is wrong."""
    view = memoryview(data).cast("B")
    if len(view) < _FRAME_HEAD.size + _TABLE_HEAD.size:
        raise ShardFormatError(f"shard {key}: {len(view)} bytes is too short for a frame table")
    magic, length = _FRAME_HEAD.unpack_from(view, 0)
    if magic != SKIPPABLE_MAGIC:
        raise ShardFormatError(
            f"shard {key}: starts with {magic:#010x}, not the frame-table magic {SKIPPABLE_MAGIC:#x}"
        )
    tag, fmt, n, fp, base_fp = _TABLE_HEAD.unpack_from(view, _FRAME_HEAD.size)
    if tag != TAG:
        raise ShardFormatError(f"shard {key}: frame table tag {tag!r} is not {TAG!r}")
    if fmt != FORMAT:
        raise ShardFormatError(f"shard {key}: format {fmt} is not supported (this reader knows {FORMAT})")
    if length != _TABLE_HEAD.size + 16 * n or len(view) < _FRAME_HEAD.size + length:
        raise ShardFormatError(f"shard {key}: frame table of {length} bytes does not hold {n} frames")
    start = _FRAME_HEAD.size + _TABLE_HEAD.size
    sizes = np.frombuffer(view[start : start + 16 * n], _SIZES)
    raw_sizes = [int(s) for s in sizes[:n]]
    stored = [int(s) for s in sizes[n:]]
    pos = _FRAME_HEAD.size + length
    if pos + sum(stored) != len(view):
        raise ShardFormatError(f"shard {key}: frames add up to {pos + sum(stored)} bytes, the shard has {len(view)}")
    frames: list[memoryview] = []
    offsets: list[int] = []
    raw = 0
    for rs, ss in zip(raw_sizes, stored, strict=True):
        frames.append(view[pos : pos + ss])
        offsets.append(raw)
        pos += ss
        raw += rs
    return ShardTable(frames, offsets, raw_sizes, raw, fp, base_fp)
