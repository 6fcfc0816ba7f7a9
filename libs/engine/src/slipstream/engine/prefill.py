"""Prefill planning: which admitted rows share a prompt prefix, and which rows go through one forward.

Pure functions over `(sequence, keep)` rows, where `keep` is how many of the row's leading tokens
its cache slot already holds; the engine (engine.py) runs the forwards and copies the caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # sequence.py imports torch; serve's episode recorder uses shared_prefix without it
    from slipstream.engine.sequence import SequenceState

Row = tuple["SequenceState", int]

# Most tokens (rows x padded width) one prefill forward takes; more rows wait for the next one.
PREFILL_CHUNK_TOKENS = 8192
# Shortest prompt prefix worth copying from another slot's cache instead of recomputing.
MIN_SHARED_PREFIX = 4


def shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefix_clusters(fresh: list[SequenceState]) -> list[tuple[list[SequenceState], int]]:
    """Rows (from empty slots) whose prompts open with the same tokens, and that common length.

    Sorted by their tokens, neighbours that share at least `MIN_SHARED_PREFIX` tokens form a
    cluster; a row joins unless it would shrink the tokens the cluster saves (shared x (members -
    1)). The length leaves every member at least its last token to forward (its logits are
    sampled). Only clusters of two or more rows are returned; the first member is the one whose
    forward the others copy.
    """
    rows = sorted(fresh, key=lambda s: s.tokens)
    out: list[tuple[list[SequenceState], int]] = []
    i = 0
    while i < len(rows):
        root = rows[i]
        shared, j = len(root.tokens) - 1, i + 1
        while j < len(rows):
            n = min(shared_prefix(root.tokens, rows[j].tokens), len(rows[j].tokens) - 1)
            if n < MIN_SHARED_PREFIX or n * (j - i) < shared * (j - i - 1):
                break
            shared = min(shared, n)
            j += 1
        if j - i > 1:
            out.append((rows[i:j], shared))
        i = j
    return out


def prefill_chunks(work: list[Row], max_seq_len: int) -> list[list[Row]]:
    """Rows grouped for batched forwards, longest first, right-padded to the chunk's longest.

    A row joins a chunk while padding stays under a quarter of the chunk's tokens, the chunk
    stays under `PREFILL_CHUNK_TOKENS`, and its padded positions stay inside the cache.
    """
    items = sorted(work, key=lambda w: len(w[0].tokens) - w[1], reverse=True)
    chunks: list[list[Row]] = []
    width = real = 0
    for seq, keep in items:
        n = len(seq.tokens) - keep
        if chunks:
            size = (len(chunks[-1]) + 1) * width
            if size <= PREFILL_CHUNK_TOKENS and size <= 1.25 * (real + n) and keep + width <= max_seq_len:
                chunks[-1].append((seq, keep))
                real += n
                continue
        chunks.append([(seq, keep)])
        width, real = n, n
    return chunks
