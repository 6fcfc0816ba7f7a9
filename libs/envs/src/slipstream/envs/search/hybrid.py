"""The default `hybrid` backend: libs/retrieval's in-process index over the environment's corpus.

Built once per corpus per process (the MiniLM encode of a few hundred short documents takes tens
of seconds on a loaded 2-core machine) and shared by every episode after. It needs the retrieval
lib's `hybrid` extra (torch, transformers, bm25s), which worker and dev installs have; imported
only when an episode asks for it, so loading the environment alone stays light.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Sequence

import msgspec

from slipstream.retrieval.types import Document, SearchBackend, TokenCounter

_BUILT: dict[str, SearchBackend] = {}
_LOCK = threading.Lock()


def hybrid_backend(documents: Sequence[Document], count_tokens: TokenCounter) -> SearchBackend:
    """BM25 + MiniLM, RRF k=60, cosine rerank of the top 50 (see libs/retrieval backend.py)."""
    try:
        from slipstream.retrieval.backend import HybridSearch
        from slipstream.retrieval.dense import MiniLM
        from slipstream.retrieval.index import build_index, corpus_key
    except ImportError as exc:
        raise LookupError(
            f"the hybrid search backend needs slipstream-retrieval[hybrid] (torch, transformers, bm25s): {exc}"
        ) from exc
    key = corpus_key(documents)
    with _LOCK:
        if key not in _BUILT:
            encoder = MiniLM()
            index = build_index(documents, encoder)
            # Budgets are in the environment's units (its policy's tokens): size chunks the same way.
            index.chunks = [msgspec.structs.replace(c, tokens=count_tokens(c.text)) for c in index.chunks]
            _BUILT[key] = HybridSearch(index, encoder)
        return _BUILT[key]


def bm25_backend(documents: Sequence[Document], count_tokens: TokenCounter) -> SearchBackend:
    """BM25 only (libs/retrieval lexical_backend.py): no dense model, builds in milliseconds.

    The CPU demo's backend (`slipstream demo --env search`), where every process that plays
    episodes builds its own backend and the MiniLM encode would cost each of them tens of seconds."""
    try:
        from slipstream.retrieval.lexical_backend import LexicalSearch
    except ImportError as exc:
        raise LookupError(f"the bm25 search backend needs slipstream-retrieval[hybrid] (bm25s): {exc}") from exc
    key = "bm25:" + _corpus_digest(documents)
    with _LOCK:
        if key not in _BUILT:
            _BUILT[key] = LexicalSearch(documents, count_tokens)
        return _BUILT[key]


def _corpus_digest(documents: Sequence[Document]) -> str:
    h = hashlib.sha256()
    for d in documents:
        h.update(msgspec.msgpack.encode(d))
    return h.hexdigest()[:24]
