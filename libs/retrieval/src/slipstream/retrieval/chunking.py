"""Cutting documents into chunks: the unit a search returns, the model reads and the harness prunes.

A document is split at paragraph breaks, a paragraph longer than the chunk size at sentence
ends, and a sentence longer than that at word boundaries; the pieces are then packed greedily,
in order, into chunks of at most `max_tokens` tokens (a single word longer than that is the one
case a chunk may exceed it). Chunks never overlap, so every word of a document is in exactly
one chunk (whitespace between pieces is normalised) and a fact is found in one place. Chunk ids
are `<doc_id>#<n>`, `n` counting from 0 in document order.

Token counts come from a `TokenCounter` (the policy's tokenizer, in the harness's units); two
named ones ship here so a stored index can say which it used: `bytes` (UTF-8 bytes: the
byte-level tiny models) and `approx` (one token per 4 characters, rounded up).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator

from slipstream.retrieval.types import Chunk, Document, TokenCounter

_PARAGRAPH = re.compile(r"\n\s*\n")
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
_ID_SEPARATOR = "#"


def utf8_bytes(text: str) -> int:
    """Tokens of a byte-level tokenizer: one per UTF-8 byte."""
    return len(text.encode("utf-8"))


def approx_tokens(text: str) -> int:
    """About one token per 4 characters (how subword tokenizers average on English prose)."""
    return math.ceil(len(text) / 4)


COUNTERS: dict[str, TokenCounter] = {"bytes": utf8_bytes, "approx": approx_tokens}


def counter_named(name: str) -> TokenCounter:
    try:
        return COUNTERS[name]
    except KeyError:
        raise ValueError(f"unknown token counter {name!r}; known: {', '.join(COUNTERS)}") from None


def chunk_id(doc_id: str, n: int) -> str:
    return f"{doc_id}{_ID_SEPARATOR}{n}"


def doc_of(chunk_id_: str) -> str:
    """The document id a chunk id names (`"d7#3"` -> `"d7"`)."""
    doc, sep, n = chunk_id_.rpartition(_ID_SEPARATOR)
    if not sep or not doc or not n.isdigit():
        raise ValueError(f"{chunk_id_!r} is not a chunk id (<doc_id>#<n>)")
    return doc


def _pieces(text: str, max_tokens: int, count: TokenCounter) -> Iterator[str]:
    """Paragraphs, or their sentences, or a sentence's word runs: each at most `max_tokens` if possible."""
    for para in _PARAGRAPH.split(text):
        para = para.strip()
        if not para:
            continue
        if count(para) <= max_tokens:
            yield para
            continue
        for sentence in _SENTENCE_END.split(para):
            if count(sentence) <= max_tokens:
                yield sentence
                continue
            run: list[str] = []
            for word in sentence.split():
                if run and count(" ".join([*run, word])) > max_tokens:
                    yield " ".join(run)
                    run = []
                run.append(word)
            if run:
                yield " ".join(run)


def chunk_document(doc: Document, *, max_tokens: int, count: TokenCounter) -> list[Chunk]:
    """`doc` as chunks of at most `max_tokens` tokens (see the module docstring for the rule)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not doc.doc_id or _ID_SEPARATOR in doc.doc_id or any(c.isspace() for c in doc.doc_id):
        raise ValueError(f"document id {doc.doc_id!r} must be non-empty, without '#' or whitespace")
    texts: list[str] = []
    current: list[str] = []
    # Pieces are joined by a blank line when they were paragraphs; sentences and word runs by a
    # space. Telling them apart is not worth it: the chunk's text is for reading and matching.
    for piece in _pieces(doc.text, max_tokens, count):
        if current and count("\n".join([*current, piece])) > max_tokens:
            texts.append("\n".join(current))
            current = []
        current.append(piece)
    if current:
        texts.append("\n".join(current))
    return [
        Chunk(chunk_id=chunk_id(doc.doc_id, n), doc_id=doc.doc_id, text=text, tokens=count(text))
        for n, text in enumerate(texts)
    ]


def chunk_corpus(docs: Iterable[Document], *, max_tokens: int, count: TokenCounter) -> list[Chunk]:
    """Every document's chunks, in corpus order. Duplicate document ids are an error."""
    seen: set[str] = set()
    out: list[Chunk] = []
    for doc in docs:
        if doc.doc_id in seen:
            raise ValueError(f"document id {doc.doc_id!r} appears twice in the corpus")
        seen.add(doc.doc_id)
        out.extend(chunk_document(doc, max_tokens=max_tokens, count=count))
    return out
