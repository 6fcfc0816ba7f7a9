"""The engine's key/value cache: a fixed pool of slots, one per concurrently running sequence.

Each layer owns two tensors [slots, max_seq_len, kv_heads, head_dim]. A sequence keeps its slot
from prefill to finish; row b of a forward writes at its own positions in its own slot, so rows
of different lengths decode together without padding or copying caches around. The pool is
allocated once, so memory use is known at start-up and never grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SlotSelection:
    """Which slots a forward touches: an index tensor, and the first slot when they are consecutive."""

    index: Tensor
    start: int | None

    @property
    def size(self) -> int:
        return int(self.index.numel())


class KVCache:
    """Per-layer key/value tensors for `slots` sequences of up to `max_seq_len` tokens."""

    def __init__(
        self,
        *,
        layers: int,
        slots: int,
        max_seq_len: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (slots, max_seq_len, kv_heads, head_dim)
        # Zeros, not empty: masked-out keys still flow through the attention matmul, and garbage
        # (NaN/inf) there would poison the masked softmax.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = slots
        self.max_seq_len = max_seq_len

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    def select(self, slots: list[int]) -> SlotSelection:
        """Index for `slots`; consecutive slots are read as a view instead of a gather."""
        if not slots:
            raise ValueError("KVCache.select needs at least one slot")
        bad = [s for s in slots if not 0 <= s < self.slots]
        if bad:
            raise ValueError(f"KVCache slots {bad} out of range [0, {self.slots})")
        start = slots[0] if slots == list(range(slots[0], slots[0] + len(slots))) else None
        index = torch.tensor(slots, dtype=torch.long, device=self.k[0].device)
        return SlotSelection(index=index, start=start)

    def write(self, layer: int, sel: SlotSelection, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [B, T, kv, D] of row b at `positions[b]` in slot `sel.index[b]`."""
        rows = sel.index[:, None]
        self.k[layer][rows, positions] = k
        self.v[layer][rows, positions] = v

    def read(self, layer: int, sel: SlotSelection, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values [B, kv, span, D] of the selected slots, positions 0..span-1."""
        if sel.start is not None:
            k = self.k[layer][sel.start : sel.start + sel.size, :span]
            v = self.v[layer][sel.start : sel.start + sel.size, :span]
        else:
            k = self.k[layer][:, :span].index_select(0, sel.index)
            v = self.v[layer][:, :span].index_select(0, sel.index)
        return k.transpose(1, 2), v.transpose(1, 2)
