"""Documents, chunks and the search backend interface.

A corpus is a list of `Document`s; an index cuts each into `Chunk`s (the unit a search returns,
the model reads and the harness prunes). Chunk ids are stable strings `<doc_id>#<n>` so a pruned
chunk, a seen-chunk exclusion and a reward's "documents seen" all name the same thing.

Budgets are in tokens of the policy's tokenizer: the backend is built with a `TokenCounter`
and cuts every answer to the budget the harness passes (whole chunks only, best first).
`exclude` is the harness's hidden seen-chunk list: excluded chunks are never returned; the
model never sees or sets it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Protocol

import msgspec

TokenCounter = Callable[[str], int]


class Document(msgspec.Struct, frozen=True, kw_only=True):
    """One corpus document."""

    doc_id: str
    title: str = ""
    text: str


class Chunk(msgspec.Struct, frozen=True, kw_only=True):
    """A contiguous piece of one document, as a search returns it."""

    chunk_id: str  # "<doc_id>#<n>", n counting from 0 in document order
    doc_id: str
    text: str
    tokens: int  # the backend's TokenCounter applied to `text`
    score: float = 0.0  # the rank score that ordered it (higher first); 0 where there is no ranking


class SearchBackend(Protocol):
    """What the search tools call. Every method returns chunks best first, cut to the budget."""

    async def search(self, query: str, *, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        """Hybrid search (BM25 + dense, RRF k=60, top 50 reranked), whole chunks up to the budget."""
        ...

    async def grep(self, pattern: str, *, exclude: Collection[str], limit: int = 5) -> list[Chunk]:
        """Chunks whose text matches the regex `pattern` (at most `limit`). Bad regex: ValueError."""
        ...

    async def read(
        self, doc_id: str, *, query: str | None, exclude: Collection[str], budget_tokens: int
    ) -> list[Chunk]:
        """A document's chunks, reranked against `query` when given, cut to the budget. Unknown id: KeyError."""
        ...
