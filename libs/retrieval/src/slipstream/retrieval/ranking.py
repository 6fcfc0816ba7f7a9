"""The pure steps between retrievers and an answer: fusion, top-k with exclusion, the budget cut.

- `rrf`: reciprocal-rank fusion. Each ranking gives an item `1 / (k + rank)` (rank from 1); an
  item's fused score is the sum over the rankings it appears in. k = 60 (Cormack et al. 2009,
  and Context-1). Ties keep first-appearance order, so fusion is deterministic.
- `top_k`: the indices of the k best scores, best first, with excluded positions masked out.
- `cut_to_budget`: whole chunks, best first, while they fit; a chunk that does not fit is
  skipped and smaller ones after it may still fill the rest (a result never ends early because
  one long chunk came up, and never holds a partial chunk).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from slipstream.retrieval.types import Chunk

RRF_K = 60


def rrf(rankings: Iterable[Sequence[str]], *, k: int = RRF_K) -> list[tuple[str, float]]:
    """Fused (item, score) pairs, best first; see the module docstring."""
    if k < 0:
        raise ValueError(f"RRF k must be >= 0, got {k}")
    scores: dict[str, float] = {}
    for ranking in rankings:
        for rank, item in enumerate(ranking, start=1):
            scores[item] = scores.get(item, 0.0) + 1.0 / (k + rank)
    # sorted() is stable: equal scores stay in first-appearance order.
    return sorted(scores.items(), key=lambda kv: -kv[1])


def top_k(scores: np.ndarray, k: int, *, masked: np.ndarray | None = None) -> np.ndarray:
    """Indices of the `k` highest scores, best first (ties: lower index first); `masked` rows never appear."""
    if k <= 0 or scores.size == 0:
        return np.empty(0, dtype=np.int64)
    work = scores.astype(np.float64, copy=True)
    if masked is not None and masked.size:
        work[masked] = -np.inf
    allowed = int(np.count_nonzero(work > -np.inf))
    k = min(k, allowed)
    if k == 0:
        return np.empty(0, dtype=np.int64)
    part = np.argpartition(-work, k - 1)[:k] if k < work.size else np.arange(work.size)
    # lexsort: primary key last; -score descending, then index ascending for ties.
    order = np.lexsort((part, -work[part]))
    return part[order].astype(np.int64)


def cut_to_budget(chunks: Iterable[Chunk], budget_tokens: int) -> list[Chunk]:
    """Whole chunks in the given (best-first) order while the running total stays within the budget."""
    if budget_tokens < 0:
        raise ValueError(f"budget_tokens must be >= 0, got {budget_tokens}")
    out: list[Chunk] = []
    left = budget_tokens
    for c in chunks:
        if c.tokens <= left:
            out.append(c)
            left -= c.tokens
        if left <= 0:
            break
    return out
