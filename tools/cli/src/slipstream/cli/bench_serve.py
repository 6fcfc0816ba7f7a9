"""`slipstream bench serve`: the OpenAI-compatible endpoint vs the engine called in-process.

One engine (a TorchEngine on a tiny preset), one run, two ways of getting the same completions:

- **in-process**: `--concurrency` workers call `engine.generate` directly with prompt ids rendered
  beforehand (the engine alone);
- **endpoint**: `--concurrency` HTTP clients POST `/v1/chat/completions` over loopback to a
  `ServeEndpoint` on that engine (validation, chat template, tokenisation, recording, JSON);
  `--client openai` uses the real `openai` AsyncOpenAI client instead of a bare aiohttp one.

Every request asks for exactly `--max-tokens` tokens (`ignore_eos`), so both modes do the same
engine work. The modes alternate within each repeat; figures are completions/s and p50/p99
request latency, and the headline is the median over repeats of endpoint/in-process throughput
(target >= 0.8). The clients run in the same process as the server, so their CPU counts against
the endpoint: the ratio is a lower bound for clients on other machines.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "serve",
        help="completions/s and p50/p99 latency through the OpenAI-compatible endpoint vs the engine in-process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--requests", type=int, default=64, help="completions per mode and repeat (default 64)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent clients = engine slots (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians reported (default 3)")
    p.add_argument("--client", choices=("aiohttp", "openai"), default="aiohttp", help="HTTP client (default aiohttp)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    for name in ("requests", "concurrency", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"slipstream bench serve: --{name.replace('_', '-')} must be >= 1")
    result = asyncio.run(run(args))
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _figures(latencies: list[float], wall: float) -> dict[str, float]:
    return {
        "completions_per_s": round(len(latencies) / wall, 2),
        "p50_ms": round(_pct(latencies, 0.50) * 1000, 1),
        "p99_ms": round(_pct(latencies, 0.99) * 1000, 1),
        "wall_s": round(wall, 3),
    }


async def _pool(n: int, concurrency: int, one: Any) -> tuple[list[float], float]:
    """Run `one(i)` for i < n with `concurrency` workers; (per-request seconds, wall seconds)."""
    latencies: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            t0 = time.perf_counter()
            await one(i)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return latencies, time.perf_counter() - t0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import aiohttp
    import torch

    from slipstream.engine import GenerationRequest, SamplingParams, TorchEngine, build_tiny
    from slipstream.serve import MemorySink, ServeConfig, ServeEndpoint

    torch.set_num_threads(args.threads)
    model, tok = build_tiny(args.preset, seed=0)
    engine = TorchEngine(model, tok, max_batch=args.concurrency, max_seq_len=512, device="cpu")
    await engine.start()
    cfg = ServeConfig(enabled=True, port=0, replay_window=args.requests * 2)
    endpoint = ServeEndpoint(engine, tok, cfg, MemorySink(), model_name="slipstream-bench")
    await endpoint.start()
    fmt = endpoint.fmt
    messages = [[{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}] for i in range(args.requests)]
    prompts = [fmt.encode(fmt.prompt_text(fmt.messages(m), None)) for m in messages]

    def params(i: int) -> SamplingParams:
        return SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i, stop=list(fmt.stop_strings))

    tag = iter(range(1 << 62))

    async def in_process(i: int) -> None:
        res = await engine.generate(
            GenerationRequest(request_id=f"b{next(tag)}", prompt_ids=prompts[i], params=params(i))
        )
        assert len(res.completion_ids) == args.max_tokens

    body = {"model": endpoint.model_name, "max_tokens": args.max_tokens, "ignore_eos": True}
    url = f"{endpoint.base_url}/chat/completions"
    http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency))
    oai = None
    if args.client == "openai":
        import openai

        oai = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key="bench", max_retries=0)

    async def via_endpoint(i: int) -> None:
        if oai is not None:
            out = await oai.chat.completions.create(
                messages=messages[i],  # type: ignore[arg-type]
                seed=i,
                extra_body={"ignore_eos": True},
                model=endpoint.model_name,
                max_tokens=args.max_tokens,
            )
            assert out.usage is not None and out.usage.completion_tokens == args.max_tokens
            return
        async with http.post(url, json={**body, "messages": messages[i], "seed": i}) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            assert data["usage"]["completion_tokens"] == args.max_tokens

    try:
        await _pool(args.concurrency, args.concurrency, in_process)  # warm-up: first-call allocations
        await _pool(args.concurrency, args.concurrency, via_endpoint)
        repeats = []
        for r in range(args.repeats):
            order = [("in_process", in_process), ("endpoint", via_endpoint)]
            if r % 2:
                order.reverse()  # alternate who goes first, so drift in machine load hits both
            rep: dict[str, Any] = {}
            for name, fn in order:
                lat, wall = await _pool(args.requests, args.concurrency, fn)
                rep[name] = _figures(lat, wall)
            rep["ratio"] = round(rep["endpoint"]["completions_per_s"] / rep["in_process"]["completions_per_s"], 3)
            repeats.append(rep)
            print(f"repeat {r}: {json.dumps(rep)}", flush=True)
    finally:
        await http.close()
        if oai is not None:
            await oai.close()
        await endpoint.close()
        await engine.stop()

    def med(mode: str, key: str) -> float:
        return statistics.median(rep[mode][key] for rep in repeats)

    summary = {
        "ratio_median": statistics.median(rep["ratio"] for rep in repeats),
        "target": 0.8,
        **{
            f"{m}_{k}": med(m, k) for m in ("in_process", "endpoint") for k in ("completions_per_s", "p50_ms", "p99_ms")
        },
    }
    config = {
        k: getattr(args, k) for k in ("preset", "requests", "concurrency", "max_tokens", "repeats", "client", "threads")
    }
    return {"config": config, "repeats": repeats, "summary": summary, "recorded": endpoint.recorder.stats()}
