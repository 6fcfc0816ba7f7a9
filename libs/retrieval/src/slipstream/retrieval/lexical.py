"""BM25 over chunks, with bm25s (sparse-matrix BM25 in numpy).

Chosen over tantivy after measuring both on one corpus (libs/retrieval/README.md, `slipstream
bench bm25`): tantivy builds ~2-3x and answers ~5x faster, but a hybrid query's time is the
MiniLM encode (~10x a bm25s query), and bm25s scores every chunk into one numpy array, so the
harness's seen-chunk exclusion is an exact mask over the whole corpus rather than an
over-fetch-then-filter, and the index is a handful of arrays that go to the object store as they
are. Parameters are Lucene's BM25 (k1 = 1.2, b = 0.75), which also made the two agree best.

Text analysis: lower case, `\\w\\w+` tokens (words of two or more letters or digits), English
stop words removed (bm25s's list), no stemming. Title and chunk text are indexed together.
"""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

K1 = 1.2
B = 0.75
_TOKEN = re.compile(r"(?u)\b\w\w+\b")
FILES = (
    "data.csc.index.npy",
    "indices.csc.index.npy",
    "indptr.csc.index.npy",
    "vocab.index.json",
    "params.index.json",
)


def _stopwords() -> frozenset[str]:
    from bm25s.stopwords import STOPWORDS_EN

    return frozenset(STOPWORDS_EN)


class Lexical:
    """A BM25 index over `n` texts; `scores(query)` gives one score per text (0 where no term matches)."""

    def __init__(self, retriever: Any, n: int) -> None:
        self._bm25 = retriever
        self.n = n
        self._stop = _stopwords()

    def terms(self, text: str) -> list[str]:
        return [t for t in _TOKEN.findall(text.lower()) if t not in self._stop]

    @classmethod
    def build(cls, texts: list[str]) -> Lexical:
        import bm25s

        stop = _stopwords()
        corpus = [[t for t in _TOKEN.findall(text.lower()) if t not in stop] for text in texts]
        retriever = bm25s.BM25(k1=K1, b=B, method="lucene")
        retriever.index(corpus, show_progress=False)
        return cls(retriever, len(texts))

    def scores(self, query: str) -> np.ndarray:
        terms = self.terms(query)
        ids = self._bm25.get_tokens_ids(terms)
        if not ids:
            return np.zeros(self.n, dtype=np.float32)
        return np.asarray(self._bm25.get_scores_from_ids(ids), dtype=np.float32)

    def to_files(self) -> dict[str, bytes]:
        """The index as bm25s writes it: {file name: bytes}."""
        with tempfile.TemporaryDirectory(prefix="bm25-") as tmp:
            self._bm25.save(tmp, show_progress=False)
            return {name: (Path(tmp) / name).read_bytes() for name in FILES}

    @classmethod
    def from_files(cls, files: dict[str, bytes], n: int) -> Lexical:
        import bm25s

        missing = sorted(set(FILES) - set(files))
        if missing:
            raise ValueError(f"BM25 index is missing files {missing}")
        with tempfile.TemporaryDirectory(prefix="bm25-") as tmp:
            for name in FILES:
                (Path(tmp) / name).write_bytes(files[name])
            retriever = bm25s.BM25.load(tmp, mmap=False, show_progress=False)
        return cls(retriever, n)
