"""The engine's key/value cache: a fixed pool of slots, one per concurrently running sequence.

Each layer owns two tensors [slots, kv_heads, max_seq_len, head_dim]: a head's keys are one
contiguous block, so attention reads them as a view, with no copy. A sequence keeps its slot
from prefill to finish; row b of a forward writes at its own positions in its own slot, so rows
of different lengths decode together without padding or copying caches around. The pool is
allocated once, so memory use is known at start-up and never grows.

A mixture-of-experts model also keeps each cached token's routes (the experts every layer sent
it to, `route_width` = layers × k bytes per position, slipstream.engine.moe) in `routes`
[slots, max_seq_len, route_width]: they belong to a position exactly as its keys do, so every
prefix copy copies them too, and a finished request reads its slot's routes back for router replay.
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
        route_width: int = 0,
    ) -> None:
        shape = (slots, kv_heads, max_seq_len, head_dim)
        # Zeros, not empty: masked-out keys still flow through the attention matmul, and garbage
        # (NaN/inf) there would poison the masked softmax.
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.slots = slots
        self.max_seq_len = max_seq_len
        self.kv_heads = kv_heads
        self.route_width = route_width
        self.routes: Tensor | None = (
            torch.zeros((slots, max_seq_len, route_width), dtype=torch.uint8, device=device) if route_width else None
        )

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

    def flat_index(self, sel: SlotSelection, positions: Tensor) -> Tensor:
        """Row indices [B*kv*T] into a layer's cache viewed as [slots * kv * max_seq_len, D],
        in the order of a [B, kv, T, D] tensor's rows."""
        heads = torch.arange(self.kv_heads, device=positions.device)
        base = (sel.index[:, None] * self.kv_heads + heads[None, :]) * self.max_seq_len  # [B, kv]
        return (base[:, :, None] + positions[:, None, :]).reshape(-1)

    def write(self, layer: int, flat: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k, v [B, kv, T, D] at the rows `flat` (from `flat_index`) of the layer's cache.

        `index_copy_` on the flattened view: advanced-index assignment (`k[rows, :, positions] =`)
        goes through index_put's general path, which profiling showed at ~18 % of a bf16 decode step.
        """
        d = k.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, flat, k.reshape(-1, d))
        self.v[layer].view(-1, d).index_copy_(0, flat, v.reshape(-1, d))

    def copy_prefix(self, src: int, dst: list[int], length: int) -> None:
        """Copy the keys/values of slot `src`'s first `length` positions into each slot of `dst`."""
        if not dst or length <= 0:
            return
        index = torch.tensor(dst, dtype=torch.long, device=self.k[0].device)
        for cache in (*self.k, *self.v):
            cache[index, :, :length] = cache[src, :, :length]
        if self.routes is not None:
            self.routes[index, :length] = self.routes[src, :length]

    def write_routes(self, sel: SlotSelection, positions: Tensor, routes: Tensor) -> None:
        """Store routes [B, T, route_width] of the selected slots' tokens at `positions` [B, T]."""
        if self.routes is None:
            raise ValueError("KVCache.write_routes on a cache built without route_width")
        self.routes[sel.index[:, None], positions] = routes.to(torch.uint8)

    def route_bytes(self, slot: int, length: int) -> bytes:
        """The routes of slot `slot`'s first `length` positions, uint8 token-major ('' without routes)."""
        if self.routes is None or length <= 0:
            return b""
        return bytes(self.routes[slot, :length].cpu().numpy().tobytes())

    def read(self, layer: int, sel: SlotSelection, span: int) -> tuple[Tensor, Tensor]:
        """Keys and values [B, kv, span, D] of the selected slots, positions 0..span-1."""
        if sel.start is not None:
            k = self.k[layer][sel.start : sel.start + sel.size, :, :span]
            v = self.v[layer][sel.start : sel.start + sel.size, :, :span]
        else:
            k = self.k[layer][:, :, :span].index_select(0, sel.index)
            v = self.v[layer][:, :, :span].index_select(0, sel.index)
        return k, v
