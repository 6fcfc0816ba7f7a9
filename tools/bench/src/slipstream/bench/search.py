"""`slipstream bench search`: hybrid search through the tool service vs the same retrieval in-process.

A seeded synthetic corpus (libs/retrieval `synthetic.py`; `--docs` documents, at least 20,000
chunks of at most `--chunk-tokens` tokens) is indexed once (chunking, BM25 with bm25s, MiniLM
vectors) into the object store under a key named by its content (`--store`, default
.slipstream/store); a later run finds it there and loads it (`index_reused`, with the build
times its manifest recorded; `--rebuild` builds again). Then, in one run:

- in-process: `search_corpus` through `LocalTransport` over `HybridSearch` on the loaded index;
- service: a real nats-server and one tool-service replica serving the `search` tool set from
  the same stored index, `search_corpus` through `NatsTransport`.

The same `--queries` queries (a few words from a random document each) run with `--concurrency`
calls in flight, the two modes alternating over `--repeats` rounds (the first mode alternates
too, so drifting machine load favours neither). Reported: queries/s per mode (median over
rounds), the service/in-process ratio (median of each round's ratio; target >= 0.80), p50/p99
latency per query, the index build time (chunking, BM25 and dense separately), the share of
queries whose source document came back first, and whether both modes answered identically.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.bench.main import percentile, write_json

TARGET = 0.80
MIN_CHUNKS = 20_000


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "search",
        help="hybrid-search queries/s through the tool service vs in-process, on a 20k-chunk corpus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--docs", type=int, default=3200, help="documents in the corpus (default 3200: ~21k chunks)")
    p.add_argument("--chunk-tokens", type=int, default=64, help="chunk size, approx tokens (default 64)")
    p.add_argument("--seed", type=int, default=0, help="corpus and query seed (default 0)")
    p.add_argument("--queries", type=int, default=200, help="queries per mode and round (default 200)")
    p.add_argument("--concurrency", type=int, default=4, help="calls in flight at once (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="rounds of both modes; medians reported (default 3)")
    p.add_argument("--budget", type=int, default=512, help="tokens per search result (default 512)")
    p.add_argument("--store", default=".slipstream/store", help="local object store directory for the index")
    p.add_argument("--rebuild", action="store_true", help="build the index even if the store has it")
    p.add_argument("--build-threads", type=int, default=2, help="torch threads while building vectors (default 2)")
    p.add_argument("--min-chunks", type=int, default=MIN_CHUNKS, help=f"refuse a smaller corpus (default {MIN_CHUNKS})")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(_measure(args))
    write_json(result, args.json)
    return 0


async def _round(transport: Any, queries: list[str], *, concurrency: int, budget: int, tag: str) -> dict[str, Any]:
    from slipstream.toolcalls import ToolCall

    slots = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    texts: list[str] = []

    async def one(i: int, q: str) -> str:
        async with slots:
            t0 = time.perf_counter()
            r = await transport.invoke(
                ToolCall(id=f"{tag}-{i}", name="search_corpus", arguments={"query": q, "_budget": budget})
            )
            latencies.append(time.perf_counter() - t0)
        if r.outcome != "ok":
            raise RuntimeError(f"{tag}: query {q!r} failed: {r.outcome}/{r.kind}: {r.text}")
        return str(r.text)

    t0 = time.perf_counter()
    texts = list(await asyncio.gather(*(one(i, q) for i, q in enumerate(queries))))
    wall = time.perf_counter() - t0
    return {
        "qps": len(queries) / wall,
        "wall_s": wall,
        "p50_ms": 1000 * percentile(latencies, 0.50),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "texts": texts,
    }


def _start_replica(nats_url: str, store: str, key: str, root: Path) -> Any:
    import os

    from slipstream.stack.process import ManagedProcess

    options = {"search": {"index": key, "store": {"type": "local", "root": str(Path(store).resolve())}}}
    port_file = root / "tool-service.port"
    argv = [
        sys.executable,
        "-m",
        "slipstream.tool_service",
        "--bus.url",
        nats_url,
        "--service.replica",
        "bench",
        "--service.port-file",
        str(port_file),
        "--serve.sets",
        json.dumps(["search"]),
        "--serve.options",
        json.dumps(options),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLIPSTREAM_", "OTEL_"))}
    proc = ManagedProcess("tool-service", argv, root / "tool-service.log", env=env)
    deadline = time.monotonic() + 600
    import http.client

    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"tool-service exited:\n{proc.tail()}")
        text = port_file.read_text().strip() if port_file.exists() else ""
        if text:
            conn = http.client.HTTPConnection("127.0.0.1", int(text), timeout=5)
            try:
                conn.request("GET", "/readyz")
                if conn.getresponse().status == 200:
                    return proc
            except OSError:
                pass
            finally:
                conn.close()
        time.sleep(0.2)
    proc.stop()
    raise RuntimeError(f"tool-service not ready in 600 s:\n{proc.tail()}")


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.retrieval.backend import HybridSearch
    from slipstream.retrieval.dense import MiniLM
    from slipstream.retrieval.index import IndexParams, build_index, corpus_key, load_index, read_manifest, save_index
    from slipstream.retrieval.synthetic import synthetic_corpus, synthetic_queries
    from slipstream.retrieval.tools import chunk_ids_of, search_tools
    from slipstream.stack import start_nats
    from slipstream.store import LocalObjectStore
    from slipstream.toolcalls import LocalTransport, ToolRegistry
    from slipstream.toolcalls.remote import NatsTransport

    docs = synthetic_corpus(args.docs, seed=args.seed)
    params = IndexParams(max_chunk_tokens=args.chunk_tokens, counter="approx")
    store = LocalObjectStore(args.store)
    key = corpus_key(docs, params)
    reused = not args.rebuild and read_manifest(store, key) is not None
    if reused:
        print(f"index {key}: found in {args.store}, loading", flush=True)
    else:
        print(f"building the index of {len(docs)} documents ({args.build_threads} torch threads) ...", flush=True)
        index = build_index(docs, MiniLM(threads=args.build_threads), params)
        save_index(store, key, index)
    t0 = time.perf_counter()
    index = load_index(store, key)
    load_s = time.perf_counter() - t0
    chunks = len(index.chunks)
    if chunks < args.min_chunks:
        raise SystemExit(f"bench search: the corpus has {chunks} chunks, fewer than {args.min_chunks}; raise --docs")
    print(
        f"index: {len(index.docs)} documents, {chunks} chunks; built in chunking {index.build_s['chunking']:.1f} s, "
        f"BM25 {index.build_s['bm25']:.1f} s, dense {index.build_s['dense']:.1f} s"
        f"{' (as recorded when it was built)' if reused else ''}; loaded in {load_s:.1f} s",
        flush=True,
    )

    encoder = MiniLM(threads=1)  # as a replica runs: one thread per query, queries in parallel
    backend = HybridSearch(index, encoder)
    local = LocalTransport(ToolRegistry(search_tools(backend, titles=index.titles())))
    pairs = synthetic_queries(docs, args.queries, seed=args.seed + 1)
    queries = [q for q, _ in pairs]

    with tempfile.TemporaryDirectory(prefix="bench-search-") as tmp:
        root = Path(tmp)
        nats = start_nats(root / "nats", root / "logs")
        replica = None
        remote = None
        try:
            t0 = time.perf_counter()
            replica = _start_replica(nats.url, args.store, key, root)
            replica_s = time.perf_counter() - t0
            print(f"tool-service replica ready in {replica_s:.1f} s", flush=True)
            remote = await NatsTransport.connect(nats.url, ToolRegistry(search_tools(None)), name="bench-search")
            modes = {"in_process": local, "service": remote}
            for name, t in modes.items():  # warm both: first-call allocations, connections
                await _round(t, queries[:8], concurrency=args.concurrency, budget=args.budget, tag=f"warm-{name}")
            rounds: list[dict[str, Any]] = []
            for rep in range(args.repeats):
                order = ["in_process", "service"] if rep % 2 == 0 else ["service", "in_process"]
                row: dict[str, Any] = {}
                for name in order:
                    row[name] = await _round(
                        modes[name], queries, concurrency=args.concurrency, budget=args.budget, tag=f"{name}-{rep}"
                    )
                row["ratio"] = row["service"]["qps"] / row["in_process"]["qps"]
                print(
                    f"round {rep + 1}/{args.repeats}: in-process {row['in_process']['qps']:.1f} q/s, "
                    f"service {row['service']['qps']:.1f} q/s, ratio {row['ratio']:.2f}",
                    flush=True,
                )
                rounds.append(row)
        finally:
            if remote is not None:
                await remote.close()
            if replica is not None:
                replica.stop()
            nats.stop()

    same = sum(a == b for r in rounds for a, b in zip(r["in_process"]["texts"], r["service"]["texts"], strict=True))
    total = sum(len(r["service"]["texts"]) for r in rounds)
    first_hit = statistics.mean(
        1.0 if (ids := chunk_ids_of(text)) and ids[0].rsplit("#", 1)[0] == doc else 0.0
        for text, (_, doc) in zip(rounds[0]["in_process"]["texts"], pairs, strict=True)
    )

    def med(mode: str, field: str) -> float:
        return statistics.median(r[mode][field] for r in rounds)

    ratio = statistics.median(r["ratio"] for r in rounds)
    result = {
        "bench": "search",
        "corpus": {
            "documents": len(index.docs),
            "chunks": chunks,
            "chunk_tokens": args.chunk_tokens,
            "seed": args.seed,
        },
        "index": {
            "key": key,
            "reused": reused,
            "build_s": dict(index.build_s),
            "load_s": load_s,
            "build_threads": args.build_threads,
        },
        "queries": args.queries,
        "concurrency": args.concurrency,
        "budget_tokens": args.budget,
        "repeats": args.repeats,
        "torch_threads_per_query": 1,
        "in_process": {
            "qps": med("in_process", "qps"),
            "p50_ms": med("in_process", "p50_ms"),
            "p99_ms": med("in_process", "p99_ms"),
        },
        "service": {
            "qps": med("service", "qps"),
            "p50_ms": med("service", "p50_ms"),
            "p99_ms": med("service", "p99_ms"),
        },
        "ratio": ratio,
        "rounds": [
            {m: {k: v for k, v in r[m].items() if k != "texts"} for m in ("in_process", "service")}
            | {"ratio": r["ratio"]}
            for r in rounds
        ],
        "identical_answers": same / total if total else 0.0,
        "source_doc_first": first_hit,
        "torch_version": torch.__version__,
        "target": {"ratio": TARGET, "met": ratio >= TARGET},
    }
    print(
        f"in-process {result['in_process']['qps']:.1f} q/s (p50 {result['in_process']['p50_ms']:.0f} ms, "
        f"p99 {result['in_process']['p99_ms']:.0f} ms); service {result['service']['qps']:.1f} q/s "
        f"(p50 {result['service']['p50_ms']:.0f} ms, p99 {result['service']['p99_ms']:.0f} ms); "
        f"ratio {ratio:.2f} (target >= {TARGET}: {'met' if ratio >= TARGET else 'NOT met'}); "
        f"identical answers {result['identical_answers']:.3f}; source document first {first_hit:.2f}"
    )
    return result
