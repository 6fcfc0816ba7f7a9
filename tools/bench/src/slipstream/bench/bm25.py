"""`slipstream bench bm25`: bm25s (what libs/retrieval uses) vs tantivy on one corpus.

The figures behind libs/retrieval's choice of BM25 library. Both index the same chunks of the
seeded synthetic corpus (title + text, as the hybrid index does) with the same BM25 parameters
(k1 = 1.2, b = 0.75) and no stemming; bm25s through libs/retrieval's `Lexical` (its tokens:
lower-case `\\w\\w+`, English stop words removed), tantivy with its `default` tokenizer (lower
case, no stop words) and `parse_query` over the escaped query. Reported: index build seconds,
queries/s (top 10, one at a time), and agreement: the mean overlap of the two top-10 lists and
how often their first hits agree. tantivy is not a dependency of the project: install it
(`pip install tantivy==0.27.0`) to run this.
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from typing import Any

from slipstream.bench.main import write_json


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "bm25",
        help="bm25s vs tantivy: index build time, queries/s, top-10 agreement",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--docs", type=int, default=3200, help="documents (default 3200: ~21k chunks of 64 tokens)")
    p.add_argument("--chunk-tokens", type=int, default=64, help="chunk size, approx tokens (default 64)")
    p.add_argument("--queries", type=int, default=500, help="queries (default 500)")
    p.add_argument("--seed", type=int, default=0, help="corpus and query seed (default 0)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    write_json(result, args.json)
    return 0


def run(args: argparse.Namespace) -> dict[str, Any]:
    try:
        import tantivy
    except ImportError:
        raise SystemExit("bench bm25: tantivy is not installed (pip install tantivy==0.27.0)") from None
    import numpy as np

    from slipstream.retrieval.chunking import approx_tokens, chunk_corpus
    from slipstream.retrieval.index import indexed_text
    from slipstream.retrieval.lexical import K1, B, Lexical
    from slipstream.retrieval.synthetic import synthetic_corpus, synthetic_queries

    docs = synthetic_corpus(args.docs, seed=args.seed)
    titles = {d.doc_id: d.title for d in docs}
    chunks = chunk_corpus(docs, max_tokens=args.chunk_tokens, count=approx_tokens)
    texts = [indexed_text(titles[c.doc_id], c) for c in chunks]
    queries = [q for q, _ in synthetic_queries(docs, args.queries, seed=args.seed + 1)]
    print(f"{len(chunks)} chunks, {len(queries)} queries", flush=True)

    t0 = time.perf_counter()
    lexical = Lexical.build(texts)
    bm25s_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = [np.argsort(-lexical.scores(q), kind="stable")[:10].tolist() for q in queries]
    bm25s_qps = len(queries) / (time.perf_counter() - t0)

    with tempfile.TemporaryDirectory(prefix="bench-tantivy-") as tmp:
        t0 = time.perf_counter()
        builder = tantivy.SchemaBuilder()
        builder.add_integer_field("row", stored=True, indexed=True, fast=True)
        builder.add_text_field("body", stored=False, tokenizer_name="default")
        index = tantivy.Index(builder.build(), path=tmp)
        writer = index.writer(heap_size=128_000_000, num_threads=1)
        for row, text in enumerate(texts):
            writer.add_document(tantivy.Document(row=row, body=text))
        writer.commit()
        writer.wait_merging_threads()
        index.reload()
        tantivy_build = time.perf_counter() - t0
        searcher = index.searcher()
        t0 = time.perf_counter()
        theirs = []
        for q in queries:
            parsed = index.parse_query(re.sub(r"[^\w\s]", " ", q), ["body"])
            theirs.append([searcher.doc(addr)["row"][0] for _, addr in searcher.search(parsed, 10).hits])
        tantivy_qps = len(queries) / (time.perf_counter() - t0)

    overlap = statistics.mean(len(set(a) & set(b)) / 10 for a, b in zip(ours, theirs, strict=True))
    first = statistics.mean(float(a[:1] == b[:1]) for a, b in zip(ours, theirs, strict=True))
    result = {
        "bench": "bm25",
        "chunks": len(chunks),
        "queries": len(queries),
        "params": {"k1": K1, "b": B},
        "bm25s": {"build_s": bm25s_build, "qps": bm25s_qps},
        "tantivy": {"build_s": tantivy_build, "qps": tantivy_qps, "version": getattr(tantivy, "__version__", "")},
        "agreement": {"top10_overlap": overlap, "top1_same": first},
    }
    print(
        f"bm25s: build {bm25s_build:.2f} s, {bm25s_qps:.0f} q/s; tantivy: build {tantivy_build:.2f} s, "
        f"{tantivy_qps:.0f} q/s; top-10 overlap {overlap:.3f}, same first hit {first:.3f}"
    )
    return result
