"""The pure steps between retrievers and an answer: fusion, top-k with exclusion, the budget cut.

- `rrf`: reciprocal-rank fusion. Each ranking gives an item `1 / (k + rank)` (rank from 1); an
  item's fused score is the sum over the rankings it appears in. k = 60 (Cormack et al. 2009,
  and Context-1). Ties keep first-appearance order, so fusion is deterministic.
- `top_k`: the indices of the k best scores, best first, with excluded positions masked out.
- `cut_to_budget`: whole chunks, best first, while they fit; a chunk that does not fit is
  skipped and smaller ones after it may still fill the rest (a result never ends early because
  one long chunk came up, and never holds a partial chunk).
- `grep_rows`: the rows whose text matches a regular expression most often (grep_corpus), with
  one time limit for the whole scan, so a pathological pattern cannot stall a tool call.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence

import numpy as np
import regex

from slipstream.retrieval.types import Chunk

RRF_K = 60
GREP_TIMEOUT_S = 2.0
MAX_PATTERN_CHARS = 500


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


def grep_rows(
    pattern: str, texts: Sequence[str], ids: Sequence[str], *, exclude: Collection[str], limit: int
) -> list[tuple[int, int]]:
    """(row, matches) of the `limit` rows of `texts` with the most matches of `pattern`, most first
    (ties: the lower row), skipping rows whose id (`ids[row]`) is in `exclude`. A pattern longer
    than MAX_PATTERN_CHARS, one that does not compile, or a scan past GREP_TIMEOUT_S in all raises
    ValueError naming the pattern."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise ValueError(f"pattern is longer than {MAX_PATTERN_CHARS} characters")
    try:
        rx = regex.compile(pattern)
    except regex.error as exc:
        raise ValueError(f"bad regular expression {pattern!r}: {exc}") from None
    excluded = set(exclude)
    hits: list[tuple[int, int]] = []
    deadline = time.monotonic() + GREP_TIMEOUT_S
    try:
        for row, text in enumerate(texts):
            if ids[row] in excluded:
                continue
            # One time limit for the whole scan, not one per chunk.
            n = sum(1 for _ in rx.finditer(text, timeout=max(1e-3, deadline - time.monotonic())))
            if n:
                hits.append((-n, row))
    except TimeoutError:
        raise ValueError(f"pattern {pattern!r} took too long to match (over {GREP_TIMEOUT_S:g} s)") from None
    hits.sort()
    return [(row, -neg) for neg, row in hits[: max(0, limit)]]
