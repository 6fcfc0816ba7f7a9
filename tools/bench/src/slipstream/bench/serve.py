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
(target >= 0.8). By default (`--clients process`) the clients run in a child process, as clients
on other machines would, and time themselves there (its start-up excluded); with `--clients
inline` they share the server's event loop, so their CPU counts against the endpoint. Both share
the machine's cores with the server either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from typing import Any

from slipstream.bench.main import percentile, write_json


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
    p.add_argument(
        "--clients",
        choices=("process", "inline"),
        default="process",
        help="endpoint clients in a child process (default) or in the server's own event loop",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    for name in ("requests", "concurrency", "max_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"slipstream bench serve: --{name.replace('_', '-')} must be >= 1")
    result = asyncio.run(run(args))
    print(json.dumps(result["summary"], indent=2))
    write_json(result, args.json)
    return 0


def latency_figures(latencies: list[float], wall: float) -> dict[str, float]:
    """Completions/s, p50/p99 latency (ms) and wall seconds of one pool's requests."""
    return {
        "completions_per_s": round(len(latencies) / wall, 2),
        "p50_ms": round(percentile(latencies, 0.50) * 1000, 1),
        "p99_ms": round(percentile(latencies, 0.99) * 1000, 1),
        "wall_s": round(wall, 3),
    }


async def request_pool(n: int, concurrency: int, one: Any) -> tuple[list[float], float]:
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

    spec = {
        "base_url": endpoint.base_url,
        "model": endpoint.model_name,
        "client": args.client,
        "max_tokens": args.max_tokens,
        "concurrency": args.concurrency,
        "messages": messages,
    }
    inline = _Clients(spec) if args.clients == "inline" else None

    async def endpoint_pool(n: int) -> tuple[list[float], float]:
        if inline is not None:
            return await request_pool(n, args.concurrency, inline.one)
        return await _child_pool({**spec, "n": n})

    try:
        await request_pool(args.concurrency, args.concurrency, in_process)  # warm-up: first-call allocations
        await endpoint_pool(args.concurrency)
        repeats = []
        for r in range(args.repeats):
            order = ["in_process", "endpoint"]
            if r % 2:
                order.reverse()  # alternate who goes first, so drift in machine load hits both
            rep: dict[str, Any] = {}
            for name in order:
                if name == "endpoint":
                    lat, wall = await endpoint_pool(args.requests)
                else:
                    lat, wall = await request_pool(args.requests, args.concurrency, in_process)
                rep[name] = latency_figures(lat, wall)
            rep["ratio"] = round(rep["endpoint"]["completions_per_s"] / rep["in_process"]["completions_per_s"], 3)
            repeats.append(rep)
            print(f"repeat {r}: {json.dumps(rep)}", flush=True)
    finally:
        if inline is not None:
            await inline.close()
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


class _Clients:
    """The endpoint's clients: a bare aiohttp session or the real `openai` AsyncOpenAI client."""

    def __init__(self, spec: dict[str, Any]) -> None:
        import aiohttp

        self.spec = spec
        self.url = f"{spec['base_url']}/chat/completions"
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=spec["concurrency"]))
        self.oai: Any = None
        if spec["client"] == "openai":
            import openai

            self.oai = openai.AsyncOpenAI(base_url=spec["base_url"], api_key="bench", max_retries=0)

    async def one(self, i: int) -> None:
        spec = self.spec
        messages = spec["messages"][i % len(spec["messages"])]
        if self.oai is not None:
            out = await self.oai.chat.completions.create(
                model=spec["model"],
                messages=messages,
                max_tokens=spec["max_tokens"],
                seed=i,
                extra_body={"ignore_eos": True},
            )
            assert out.usage is not None and out.usage.completion_tokens == spec["max_tokens"]
            return
        body = {"model": spec["model"], "messages": messages, "max_tokens": spec["max_tokens"], "seed": i}
        async with self.http.post(self.url, json={**body, "ignore_eos": True}) as resp:
            data = await resp.json()
            assert resp.status == 200, data
            assert data["usage"]["completion_tokens"] == spec["max_tokens"]

    async def close(self) -> None:
        await self.http.close()
        if self.oai is not None:
            await self.oai.close()


async def _child_pool(spec: dict[str, Any]) -> tuple[list[float], float]:
    """Run the clients in a child process (its own interpreter and CPU time); it times itself."""
    import sys

    code = "from slipstream.bench.serve import client_main; client_main()"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, json.dumps(spec), stdout=asyncio.subprocess.PIPE
    )
    out, _ = await proc.communicate()
    if proc.returncode != 0:
        raise RuntimeError(f"bench serve: the client process exited {proc.returncode}")
    result = json.loads(out.decode().strip().splitlines()[-1])
    return result["latencies"], result["wall"]


def client_main() -> None:
    """Entry of the child process: one connection warm-up per client, then the timed pool."""
    import sys

    spec = json.loads(sys.argv[1])

    async def go() -> dict[str, Any]:
        clients = _Clients(spec)
        try:
            await request_pool(spec["concurrency"], spec["concurrency"], clients.one)
            latencies, wall = await request_pool(spec["n"], spec["concurrency"], clients.one)
        finally:
            await clients.close()
        return {"latencies": latencies, "wall": wall}

    print(json.dumps(asyncio.run(go())))
