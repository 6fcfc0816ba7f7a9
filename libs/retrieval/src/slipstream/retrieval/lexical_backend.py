"""A lexical-only `SearchBackend`: BM25 (bm25s) search, regex grep and read, with no dense model.

For CPU demos and the chaos suite, where every process that plays search episodes builds its own
backend: the hybrid backend's MiniLM encode of even a few hundred short documents takes tens of
seconds per process on a loaded 2-core machine (and ~45 ms per query after), while BM25 over the
same corpus builds in milliseconds. It is a weaker retriever (no semantic match: a query
"1870s" does not match a document's "1873"), and what it ranks is the same chunks the hybrid
backend would return, cut to the same budgets, with the same exclusion and error contract:

- search(query): BM25 scores over every chunk (title + text, as the hybrid index sees them),
  excluded chunks and chunks with no query term masked out, best first (ties in corpus order),
  whole chunks up to the budget;
- grep(pattern): chunks whose indexed text matches the regex, most matches first, at most
  `limit` (a bad regex is ValueError; the `regex` module's time limit applies);
- read(doc_id): the document's unseen chunks, ordered by BM25 against `query` when given (else in
  document order), cut to the budget (an unknown id is KeyError).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import msgspec
import numpy as np

from slipstream.retrieval.chunking import chunk_corpus
from slipstream.retrieval.index import indexed_text
from slipstream.retrieval.lexical import Lexical
from slipstream.retrieval.ranking import cut_to_budget, grep_rows, top_k
from slipstream.retrieval.types import Chunk, Document, TokenCounter


class LexicalSearch:
    """BM25-only `SearchBackend` over one corpus, in this process."""

    def __init__(
        self,
        documents: Sequence[Document],
        count_tokens: TokenCounter,
        *,
        max_chunk_tokens: int = 256,
        candidates: int = 50,
    ) -> None:
        if candidates < 1 or max_chunk_tokens < 1:
            raise ValueError(f"candidates and max_chunk_tokens must be >= 1, got {candidates}, {max_chunk_tokens}")
        self.candidates = candidates
        self.chunks: list[Chunk] = chunk_corpus(documents, max_tokens=max_chunk_tokens, count=count_tokens)
        titles = {d.doc_id: d.title for d in documents}
        self.rows_of_doc: dict[str, list[int]] = {d.doc_id: [] for d in documents}
        for row, c in enumerate(self.chunks):
            self.rows_of_doc[c.doc_id].append(row)
        self.row_of = {c.chunk_id: i for i, c in enumerate(self.chunks)}
        self._texts = [indexed_text(titles.get(c.doc_id, ""), c) for c in self.chunks]
        self.lexical = Lexical.build(self._texts)

    def _mask(self, exclude: Collection[str]) -> np.ndarray:
        return np.asarray([self.row_of[c] for c in exclude if c in self.row_of], dtype=np.int64)

    def _scored(self, row: int, score: float) -> Chunk:
        return msgspec.structs.replace(self.chunks[row], score=round(float(score), 6))

    def search_sync(self, query: str, *, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        scores = self.lexical.scores(query)
        masked = np.union1d(self._mask(exclude), np.flatnonzero(scores <= 0))
        rows = top_k(scores, self.candidates, masked=masked)
        return cut_to_budget([self._scored(int(r), scores[r]) for r in rows], budget_tokens)

    async def search(self, query: str, *, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        return self.search_sync(query, exclude=exclude, budget_tokens=budget_tokens)

    def grep_sync(self, pattern: str, *, exclude: Collection[str], limit: int = 5) -> list[Chunk]:
        ids = [c.chunk_id for c in self.chunks]
        return [self._scored(row, n) for row, n in grep_rows(pattern, self._texts, ids, exclude=exclude, limit=limit)]

    async def grep(self, pattern: str, *, exclude: Collection[str], limit: int = 5) -> list[Chunk]:
        return self.grep_sync(pattern, exclude=exclude, limit=limit)

    def read_sync(self, doc_id: str, *, query: str | None, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        rows_all = self.rows_of_doc.get(doc_id)
        if rows_all is None:
            raise KeyError(f"no document {doc_id!r} in the corpus")
        excluded = set(exclude)
        rows = [r for r in rows_all if self.chunks[r].chunk_id not in excluded]
        if not rows:
            return []
        if query:
            scores = self.lexical.scores(query)
            # Stable: equal scores keep document order.
            order = sorted(rows, key=lambda r: -float(scores[r]))
            ranked = [self._scored(r, scores[r]) for r in order]
        else:
            ranked = [self.chunks[r] for r in rows]
        return cut_to_budget(ranked, budget_tokens)

    async def read(
        self, doc_id: str, *, query: str | None, exclude: Collection[str], budget_tokens: int
    ) -> list[Chunk]:
        return self.read_sync(doc_id, query=query, exclude=exclude, budget_tokens=budget_tokens)


def lexical_backend(documents: Sequence[Document], count_tokens: TokenCounter) -> LexicalSearch:
    """The `bm25` backend factory: `factory(documents, count_tokens)` as the search env builds backends."""
    return LexicalSearch(documents, count_tokens)
