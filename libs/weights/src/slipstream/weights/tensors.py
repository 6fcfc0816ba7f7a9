"""Tensors <-> bytes without copies where torch allows, for any dtype including bfloat16.

numpy has no bfloat16, so tensors are viewed as raw uint8 bit patterns; the dtype travels by
name in the manifest (`TensorEntry.dtype`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Any

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
    "bool": torch.bool,
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"unsupported tensor dtype {dtype} for weight transfer; supported: {sorted(_DTYPES)}")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r} in manifest; supported: {sorted(_DTYPES)}") from None


def as_bytes_view(t: torch.Tensor) -> memoryview:
    """The tensor's bytes (CPU, contiguous) as a memoryview; copies only when it must."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    # reshape(-1) first: a 0-dim tensor cannot change its element size with view().
    raw: Any = t.contiguous().reshape(-1).view(torch.uint8).numpy()  # numpy arrays are buffers
    return memoryview(raw)


def from_bytes(buf: bytes | bytearray | memoryview, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor over `buf` (copied once so the result owns writable memory)."""
    raw = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
    return raw.view(dtype_from_name(dtype)).reshape(shape)


def digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over named tensors (names, dtypes, shapes, bytes), in name order: equal digests mean
    bit-identical weights. A rollout worker reports its engine's as `weights_sha256`."""
    h = hashlib.sha256()
    for name, value in sorted(tensors.items()):
        h.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
        h.update(as_bytes_view(value))
    return h.hexdigest()


def shares_memory(a: Iterable[torch.Tensor], b: Iterable[torch.Tensor]) -> bool:
    """Whether any tensor of `a` shares a byte of memory with any tensor of `b` (same device)."""
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), side)
        for side, ts in enumerate((a, b))
        for t in ts
        if t.numel()
    )
    reach = [0, 0]  # the furthest end seen so far on each side
    for lo, hi, side in spans:
        if lo < reach[1 - side]:
            return True
        reach[side] = max(reach[side], hi)
    return False
