"""A small deterministic `SearchBackend` for the search environment's harness tests.

The harness rules (budgets, exclusion, refusals, prunes) are what those tests check, not
retrieval quality, so this backend ranks by plain term overlap: it is a test stand-in for the
hybrid backend of libs/retrieval, registered as backend "terms". It records every call's
arguments (`calls`) so a test can see what the harness injected. Chunks are sentence-packed up to
`chunk_bytes`, ids `<doc_id>#<n>`.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence

from slipstream.envs.search import register_backend
from slipstream.retrieval.types import Chunk, Document, TokenCounter

_WORD = re.compile(r"\w+")


class TermBackend:
    def __init__(self, documents: Sequence[Document], count: TokenCounter, *, chunk_bytes: int = 120) -> None:
        self.count = count
        self.chunks: list[Chunk] = []
        self.by_doc: dict[str, list[Chunk]] = {}
        self.calls: list[tuple[str, dict[str, object]]] = []
        for d in documents:
            pieces: list[str] = []
            for sentence in re.split(r"(?<=\.) ", d.text):
                if pieces and len(pieces[-1]) + 1 + len(sentence) <= chunk_bytes:
                    pieces[-1] += " " + sentence
                else:
                    pieces.append(sentence)
            for n, text in enumerate(pieces):
                c = Chunk(chunk_id=f"{d.doc_id}#{n}", doc_id=d.doc_id, text=text, tokens=count(text))
                self.chunks.append(c)
                self.by_doc.setdefault(d.doc_id, []).append(c)

    @staticmethod
    def _terms(text: str) -> set[str]:
        return {w.lower() for w in _WORD.findall(text)}

    def _ranked(self, query: str, chunks: Sequence[Chunk], exclude: Collection[str]) -> list[Chunk]:
        q = self._terms(query)
        scored = [(len(q & self._terms(c.text)), i, c) for i, c in enumerate(chunks) if c.chunk_id not in exclude]
        scored.sort(key=lambda t: (-t[0], t[1]))
        return [c for s, _, c in scored if s > 0 or not q]

    @staticmethod
    def _cut(chunks: list[Chunk], budget: int) -> list[Chunk]:
        out, used = [], 0
        for c in chunks:
            if used + c.tokens > budget:
                break
            out.append(c)
            used += c.tokens
        return out

    async def search(self, query: str, *, exclude: Collection[str], budget_tokens: int) -> list[Chunk]:
        self.calls.append(("search", {"query": query, "exclude": sorted(exclude), "budget_tokens": budget_tokens}))
        return self._cut(self._ranked(query, self.chunks, exclude), budget_tokens)

    async def grep(self, pattern: str, *, exclude: Collection[str], limit: int = 5) -> list[Chunk]:
        self.calls.append(("grep", {"pattern": pattern, "exclude": sorted(exclude), "limit": limit}))
        try:
            rx = re.compile(pattern)
        except re.error as exc:
            raise ValueError(str(exc)) from None
        return [c for c in self.chunks if c.chunk_id not in exclude and rx.search(c.text)][:limit]

    async def read(
        self, doc_id: str, *, query: str | None, exclude: Collection[str], budget_tokens: int
    ) -> list[Chunk]:
        self.calls.append(
            ("read", {"doc_id": doc_id, "query": query, "exclude": sorted(exclude), "budget_tokens": budget_tokens})
        )
        if doc_id not in self.by_doc:
            raise KeyError(doc_id)
        chunks = [c for c in self.by_doc[doc_id] if c.chunk_id not in exclude]
        ranked = self._ranked(query or "", chunks, ()) if query else chunks
        ranked += [c for c in chunks if c not in ranked]
        return self._cut(ranked, budget_tokens)


register_backend("terms", TermBackend)
