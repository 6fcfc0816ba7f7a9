"""Packed per-token arrays: token ids, log-probabilities and loss masks travel as raw bytes.

Lists of ints/floats cost ~15x more to encode and decode than bytes (measured: 11 us vs 181 us
for a 2,000-token trajectory), so the wire carries little-endian int32 / float32 / uint8 buffers.
This module depends on the standard library only, so the schema package stays msgspec-only.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_LITTLE = sys.byteorder == "little"


def _pack(typecode: str, values: Iterable[int] | Iterable[float]) -> bytes:
    arr = array(typecode, values)
    if not _LITTLE:  # pragma: no cover - big-endian hosts only
        arr.byteswap()
    return arr.tobytes()


def _unpack(typecode: str, data: bytes) -> array:
    arr = array(typecode)
    if len(data) % arr.itemsize:
        raise ValueError(f"packed buffer of {len(data)} bytes is not a multiple of {arr.itemsize}")
    arr.frombytes(data)
    if not _LITTLE:  # pragma: no cover
        arr.byteswap()
    return arr


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian int32."""
    return _pack("i", ids)


def unpack_ids(data: bytes) -> list[int]:
    return _unpack("i", data).tolist()


def pack_floats(values: Iterable[float]) -> bytes:
    """Log-probabilities (or any per-token float) as little-endian float32."""
    return _pack("f", values)


def unpack_floats(data: bytes) -> list[float]:
    return _unpack("f", data).tolist()


def pack_mask(mask: Iterable[int | bool]) -> bytes:
    """A loss mask as one uint8 (0/1) per token."""
    return bytes(1 if m else 0 for m in mask)


def unpack_mask(data: bytes) -> list[int]:
    return list(data)
