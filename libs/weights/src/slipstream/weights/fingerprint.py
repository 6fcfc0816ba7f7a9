"""A cheap content fingerprint of a state dict, to check that a delta lands on the base it was made from.

A delta is only correct on the exact bits it was encoded against. Version numbers alone do not
prove that (a worker could hold a mis-decoded or locally modified copy), and a full sha256 of
every tensor would cost more than decoding it (about 2 GB/s against 2 GB/s), so the fingerprint
hashes every tensor's name, dtype and shape plus `SAMPLES` evenly spaced elements of its bits.
One optimizer step changes 1-11 % of bf16 elements, so two different versions differ in
hundreds of sampled positions: the chance that they share a fingerprint is negligible. What it
does not catch is a change confined to unsampled elements (a flipped byte in a stored shard is
caught by the shard's sha256 instead).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import numpy as np
import torch

from slipstream.weights.delta import bits
from slipstream.weights.tensors import dtype_name

SAMPLES = 256
FINGERPRINT_BYTES = 32
NO_FINGERPRINT = bytes(FINGERPRINT_BYTES)  # what a keyframe records as its base


def sampled(b: np.ndarray) -> bytes:
    """`SAMPLES` evenly spaced elements of a bit array (all of them when it is smaller)."""
    step = max(1, b.size // SAMPLES)
    return b[::step][:SAMPLES].tobytes()


def part(name: str, dtype: str, shape: tuple[int, ...] | list[int], b: np.ndarray) -> bytes:
    """One tensor's share of the fingerprint: its name, dtype, shape and size, then its samples.

    Parts can be taken as each tensor is ready (on any thread) and `combine`d at the end.
    """
    return f"{name}\0{dtype}\0{','.join(map(str, shape))}\0{b.size}\0".encode() + sampled(b)


def combine(parts: Mapping[str, bytes]) -> bytes:
    """The fingerprint from every tensor's `part`, by name; the order of `parts` does not matter."""
    h = hashlib.sha256()
    for name in sorted(parts):
        h.update(parts[name])
    return h.digest()


def fingerprint_of(entries: Mapping[str, tuple[str, tuple[int, ...], np.ndarray]]) -> bytes:
    """Fingerprint from name -> (dtype name, shape, bit array); the order of `entries` does not matter."""
    return combine({name: part(name, *entry) for name, entry in entries.items()})


def fingerprint(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """The 32-byte fingerprint of a state dict's content."""
    return fingerprint_of({n: (dtype_name(t.dtype), tuple(t.shape), bits(t)) for n, t in tensors.items()})
