"""`slipstream bench engine-http`: HttpEngine to an inference server vs the same engine in-process.

The server (`python -m slipstream.serve.inference`, a TorchEngine on a preset) runs as its own
process, as a pod would; this process drives it through `HttpEngine`, and separately drives a
TorchEngine of the same preset and settings in-process. Both get the same requests
(`--requests` completions of exactly `--max-tokens` tokens, `--concurrency` at a time, seeded), in
alternating order per repeat; figures are completions/s and p50/p99 latency, and the headline is
the median over repeats of http/in-process throughput. Then weight updates: `--updates` full
versions applied through HttpEngine while nothing runs, timed from `apply_weights` until the
engine reports the version (serialise + upload + the server's copy), with the server engine's own
pause (`last_weight_apply_ms`) and the bytes per version. Both engines share the machine's cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from typing import Any

from slipstream.bench.main import write_json
from slipstream.bench.serve import latency_figures, request_pool


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "engine-http",
        help="completions/s, latency and weight-update time through HttpEngine vs the engine in-process",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.add_argument("--requests", type=int, default=64, help="completions per mode and repeat (default 64)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight = engine slots (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per completion (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians reported (default 3)")
    p.add_argument("--updates", type=int, default=5, help="full weight versions applied over HTTP (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each engine (default 1)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    for name in ("requests", "concurrency", "max_tokens", "repeats", "updates", "threads"):
        if getattr(args, name) < 1:
            raise SystemExit(f"slipstream bench engine-http: --{name.replace('_', '-')} must be >= 1")
    result = asyncio.run(run(args))
    print(json.dumps(result["summary"], indent=2))
    write_json(result, args.json)
    return 0


async def _start_server(args: argparse.Namespace) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "slipstream.serve.inference",
        "--server.port",
        "0",
        "--server.max-batch",
        str(args.concurrency),
        "--server.max-seq-len",
        "512",
        "--model.preset",
        args.preset,
        "--model.threads",
        str(args.threads),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
    )
    assert proc.stdout is not None
    while True:
        line = (await asyncio.wait_for(proc.stdout.readline(), 300)).decode()
        if not line:
            raise RuntimeError(f"bench engine-http: the server exited {await proc.wait()} before listening")
        if line.startswith("listening on "):
            return proc, line.split()[-1]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.engine import GenerationRequest, SamplingParams, TorchEngine, build_tiny
    from slipstream.serve.http_engine import HttpEngine

    torch.set_num_threads(args.threads)
    model, tok = build_tiny(args.preset, seed=0)
    local = TorchEngine(model, tok, max_batch=args.concurrency, max_seq_len=512, device="cpu")
    await local.start()
    proc, url = await _start_server(args)
    remote = HttpEngine(url)
    await remote.start()
    prompts = [tok.encode(f"Question {i}: what is {i} + {i}?") for i in range(args.requests)]
    tag = iter(range(1 << 62))

    def one(engine: Any) -> Any:
        async def call(i: int) -> None:
            params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=i)
            res = await engine.generate(
                GenerationRequest(request_id=f"b{next(tag)}", prompt_ids=prompts[i], params=params)
            )
            assert len(res.completion_ids) == args.max_tokens

        return call

    modes = {"in_process": one(local), "http": one(remote)}
    repeats: list[dict[str, Any]] = []
    updates: list[dict[str, float]] = []
    try:
        for call in modes.values():
            await request_pool(args.concurrency, args.concurrency, call)  # warm-up: first-call allocations, connections
        for r in range(args.repeats):
            order = list(modes) if r % 2 == 0 else list(reversed(modes))
            rep: dict[str, Any] = {}
            for name in order:
                rep[name] = latency_figures(*await request_pool(args.requests, args.concurrency, modes[name]))
            rep["ratio"] = round(rep["http"]["completions_per_s"] / rep["in_process"]["completions_per_s"], 3)
            repeats.append(rep)
            print(f"repeat {r}: {json.dumps(rep)}", flush=True)
        state = {n: p.detach().clone() for n, p in model.named_parameters()}
        nbytes = sum(t.numel() * t.element_size() for t in state.values())
        for v in range(1, args.updates + 1):
            tensors = {n: t + 0.001 * v for n, t in state.items()}
            t0 = time.perf_counter()
            remote.apply_weights(v, tensors)
            while remote.policy_version != v:
                if remote.stats()["weight_update_failures"]:
                    raise RuntimeError(f"bench engine-http: update {v} failed: {remote.last_update_error}")
                await asyncio.sleep(0.001)
            updates.append(
                {
                    "version": v,
                    "upload_and_apply_ms": round((time.perf_counter() - t0) * 1000, 1),
                    "engine_pause_ms": round(remote.stats()["last_weight_apply_ms"], 2),
                }
            )
        print(f"updates: {json.dumps(updates)}", flush=True)
    finally:
        await remote.stop()
        await local.stop()
        proc.terminate()
        await proc.wait()

    def med(mode: str, key: str) -> float:
        return statistics.median(rep[mode][key] for rep in repeats)

    summary = {
        "ratio_median": statistics.median(rep["ratio"] for rep in repeats),
        **{f"{m}_{k}": med(m, k) for m in modes for k in ("completions_per_s", "p50_ms", "p99_ms")},
        "update_bytes": nbytes,
        "update_upload_and_apply_ms_median": statistics.median(u["upload_and_apply_ms"] for u in updates),
        "update_engine_pause_ms_median": statistics.median(u["engine_pause_ms"] for u in updates),
    }
    config = {
        k: getattr(args, k)
        for k in ("preset", "requests", "concurrency", "max_tokens", "repeats", "updates", "threads")
    }
    return {"config": config, "repeats": repeats, "updates": updates, "summary": summary}
