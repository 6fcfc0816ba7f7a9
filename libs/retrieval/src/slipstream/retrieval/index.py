"""A hybrid index: one corpus's chunks, their BM25 index and their MiniLM vectors, stored as one unit.

Built once per corpus (`build_index`), saved to the object store (`save_index`) and loaded by
every replica and worker (`load_index`). In the store, under a key prefix:

    <prefix>/chunks.msgpack      documents (id, title, chunk range) and chunks, msgpack
    <prefix>/dense.npy           float32 [chunks, 384] unit vectors, row i = chunk i
    <prefix>/bm25/<file>         the bm25s index files
    <prefix>/manifest.json       written last: format, parameters, sizes, build times, sha256 per file

A reader trusts nothing it has not checked: a missing manifest means "not built yet", a file
whose sha256 differs from the manifest is an error naming the file. `corpus_key` names a
prefix by the corpus's content and the index parameters, so "built once per corpus" is a
lookup (`ensure_index`).
"""

from __future__ import annotations

import hashlib
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from slipstream.retrieval.chunking import chunk_corpus, counter_named
from slipstream.retrieval.dense import DIMENSIONS, MODEL_NAME, MiniLM
from slipstream.retrieval.lexical import Lexical
from slipstream.retrieval.types import Chunk, Document
from slipstream.store import ObjectNotFound, ObjectStore

FORMAT = 1


class IndexParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What an index depends on besides the documents."""

    max_chunk_tokens: int = 256  # chunk size, in the counter's tokens
    counter: str = "approx"  # a name in chunking.COUNTERS: the units of chunk sizes and budgets


class DocEntry(msgspec.Struct, frozen=True, array_like=True):
    doc_id: str
    title: str
    first: int  # index of its first chunk
    count: int  # number of chunks


class Manifest(msgspec.Struct, frozen=True, kw_only=True):
    format: int
    params: IndexParams
    model: str
    documents: int
    chunks: int
    build_s: dict[str, float]  # "chunking", "bm25", "dense": seconds each took when built
    files: dict[str, str]  # relative key -> sha256 hex


class _Stored(msgspec.Struct, array_like=True):
    docs: list[DocEntry]
    chunks: list[Chunk]


@dataclass
class HybridIndex:
    """Chunks, documents, BM25 and dense vectors of one corpus (row i of everything = chunk i)."""

    params: IndexParams
    chunks: list[Chunk]
    docs: dict[str, DocEntry]
    lexical: Lexical
    vectors: np.ndarray
    build_s: dict[str, float] = field(default_factory=dict)
    row_of: dict[str, int] = field(init=False)

    def __post_init__(self) -> None:
        if self.vectors.shape != (len(self.chunks), DIMENSIONS):
            raise ValueError(f"vectors have shape {self.vectors.shape}, expected ({len(self.chunks)}, {DIMENSIONS})")
        self.row_of = {c.chunk_id: i for i, c in enumerate(self.chunks)}

    def title(self, doc_id: str) -> str:
        entry = self.docs.get(doc_id)
        return entry.title if entry else ""

    def titles(self) -> dict[str, str]:
        """Document id -> title, for documents that have one (what the tools label chunks with)."""
        return {d.doc_id: d.title for d in self.docs.values() if d.title}


def indexed_text(title: str, chunk: Chunk) -> str:
    """What both retrievers see of a chunk: its document's title, then its text."""
    return f"{title}\n{chunk.text}" if title else chunk.text


def build_index(docs: Sequence[Document], encoder: MiniLM, params: IndexParams | None = None) -> HybridIndex:
    """Chunk the corpus, build BM25 and the dense vectors; each stage timed in `build_s`."""
    params = params or IndexParams()
    t0 = time.perf_counter()
    chunks = chunk_corpus(docs, max_tokens=params.max_chunk_tokens, count=counter_named(params.counter))
    entries: dict[str, DocEntry] = {}
    first = 0
    for doc in docs:
        n = 0
        while first + n < len(chunks) and chunks[first + n].doc_id == doc.doc_id:
            n += 1
        entries[doc.doc_id] = DocEntry(doc.doc_id, doc.title, first, n)
        first += n
    texts = [indexed_text(entries[c.doc_id].title, c) for c in chunks]
    t1 = time.perf_counter()
    lexical = Lexical.build(texts)
    t2 = time.perf_counter()
    vectors = encoder.encode(texts) if texts else np.zeros((0, DIMENSIONS), dtype=np.float32)
    t3 = time.perf_counter()
    return HybridIndex(
        params=params,
        chunks=chunks,
        docs=entries,
        lexical=lexical,
        vectors=vectors,
        build_s={"chunking": t1 - t0, "bm25": t2 - t1, "dense": t3 - t2},
    )


def corpus_key(docs: Sequence[Document], params: IndexParams | None = None, *, prefix: str = "indexes") -> str:
    """A store prefix named by the corpus's content, the parameters and the model."""
    params = params or IndexParams()
    h = hashlib.sha256()
    h.update(msgspec.json.encode([FORMAT, MODEL_NAME, params]))
    for doc in docs:
        h.update(msgspec.msgpack.encode(doc))
    return f"{prefix}/{h.hexdigest()[:24]}"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save_index(store: ObjectStore, prefix: str, index: HybridIndex) -> Manifest:
    """Write every file, then the manifest (a reader that sees the manifest sees every file)."""
    files: dict[str, bytes] = {
        "chunks.msgpack": msgspec.msgpack.encode(_Stored(docs=list(index.docs.values()), chunks=index.chunks)),
    }
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(index.vectors, dtype=np.float32), allow_pickle=False)
    files["dense.npy"] = buf.getvalue()
    for name, data in index.lexical.to_files().items():
        files[f"bm25/{name}"] = data
    store.put_many({f"{prefix}/{name}": data for name, data in files.items()})
    manifest = Manifest(
        format=FORMAT,
        params=index.params,
        model=MODEL_NAME,
        documents=len(index.docs),
        chunks=len(index.chunks),
        build_s=dict(index.build_s),
        files={name: _sha(data) for name, data in files.items()},
    )
    store.put(f"{prefix}/manifest.json", msgspec.json.encode(manifest))
    return manifest


def read_manifest(store: ObjectStore, prefix: str) -> Manifest | None:
    """The index's manifest, or None when no index is stored under `prefix`."""
    try:
        raw = store.get(f"{prefix}/manifest.json")
    except ObjectNotFound:
        return None
    try:
        manifest = msgspec.json.decode(raw, type=Manifest)
    except msgspec.ValidationError as exc:
        raise ValueError(f"index manifest {prefix}/manifest.json is not valid: {exc}") from exc
    if manifest.format != FORMAT:
        raise ValueError(f"index {prefix} has format {manifest.format}; this code reads format {FORMAT}")
    return manifest


def load_index(store: ObjectStore, prefix: str) -> HybridIndex:
    """The index stored under `prefix`, every file checked against the manifest's sha256."""
    manifest = read_manifest(store, prefix)
    if manifest is None:
        raise ObjectNotFound(f"{prefix}/manifest.json", "no index is stored here (build it first)")
    blobs = store.get_many(f"{prefix}/{name}" for name in manifest.files)
    files: dict[str, bytes] = {}
    for name, digest in manifest.files.items():
        data = blobs[f"{prefix}/{name}"]
        if _sha(data) != digest:
            raise ValueError(f"index file {prefix}/{name} does not match its sha256 in the manifest")
        files[name] = data
    stored = msgspec.msgpack.decode(files["chunks.msgpack"], type=_Stored)
    vectors = np.load(io.BytesIO(files["dense.npy"]), allow_pickle=False)
    bm25 = {name.removeprefix("bm25/"): data for name, data in files.items() if name.startswith("bm25/")}
    return HybridIndex(
        params=manifest.params,
        chunks=stored.chunks,
        docs={d.doc_id: d for d in stored.docs},
        lexical=Lexical.from_files(bm25, len(stored.chunks)),
        vectors=vectors,
        build_s=dict(manifest.build_s),
    )


def ensure_index(
    store: ObjectStore, docs: Sequence[Document], encoder: MiniLM, params: IndexParams | None = None
) -> tuple[str, HybridIndex, bool]:
    """(prefix, index, built): the corpus's stored index, built and saved first if there is none."""
    params = params or IndexParams()
    prefix = corpus_key(docs, params)
    if read_manifest(store, prefix) is not None:
        return prefix, load_index(store, prefix), False
    index = build_index(docs, encoder, params)
    save_index(store, prefix, index)
    return prefix, index, True


def describe(index: HybridIndex) -> dict[str, Any]:
    return {
        "documents": len(index.docs),
        "chunks": len(index.chunks),
        "params": msgspec.structs.asdict(index.params),
        "build_s": dict(index.build_s),
    }
