"""`slipstream bench <name>`: benchmarks, one module each under `slipstream.bench`, found lazily.

`main(argv)` is what `slipstream bench ...` calls with every argument after `bench`. A bench
module exposes `register(bench_subparsers)`, adding its sub-command and setting
`func(args) -> int` with `set_defaults`. Modules are imported only when `slipstream bench ...`
runs, so `slipstream --help` stays instant; a module that is absent is listed as unavailable
and asking for it fails with a message saying which module is missing.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

# sub-command -> module under slipstream.bench (later issues add theirs here)
BENCHES: dict[str, str] = {
    "bus": "bus",
    "async": "sync_async",
    "weights": "weights",
    "lora": "lora",
    "multiturn": "multiturn",
    "engine": "engine",
    "demo": "demo",
    "sandbox": "sandbox",
    "search": "search",
    "bm25": "bm25",
    "serve": "serve",
    "engine-http": "engine_http",
    "learner": "learner",
    "summary": "summary",
    "code-baselines": "code_baselines",
    "humaneval": "humaneval",
    "moe": "moe",
    "search-budget": "search_budget",
    "envs": "envs",
    "swarm-seeds": "swarm_seeds",
}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, str]]:
    """The `slipstream bench` parser with every available bench module; also {name: why missing}."""
    parser = argparse.ArgumentParser(prog="slipstream bench", description="Run a benchmark; figures are printed.")
    subs = parser.add_subparsers(dest="bench", metavar="BENCH")
    missing: dict[str, str] = {}
    for name, module in BENCHES.items():
        qualified = f"slipstream.bench.{module}"
        try:
            mod = importlib.import_module(qualified)
        except ModuleNotFoundError as exc:
            if exc.name != qualified:
                raise  # the module exists but one of its own imports is missing: show that
            missing[name] = f"module {qualified} is missing"
            subs.add_parser(name, help=f"(unavailable: {missing[name]})", add_help=False)
            continue
        mod.register(subs)
    return parser, missing


def main(argv: list[str]) -> int:
    """Run the bench `argv` names (`argv`: the arguments after `slipstream bench`); its exit code."""
    parser, missing = build_parser()
    # Known-args first: a missing bench's flags are not errors, the missing module is.
    bench_args, extras = parser.parse_known_args(argv)
    if bench_args.bench is None:
        parser.print_help()
        return 2
    if bench_args.bench in missing:
        parser.exit(2, f"slipstream bench: {bench_args.bench!r} is not available: {missing[bench_args.bench]}\n")
    if extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    func = getattr(bench_args, "func", None)
    if func is None:
        parser.exit(2, f"slipstream bench: {bench_args.bench!r} registered no func (set_defaults(func=...))\n")
    result = func(bench_args)
    if hasattr(result, "__await__"):
        import asyncio

        result = asyncio.run(result)
    return int(result or 0)


def write_json(result: dict[str, Any], path: str) -> None:
    """Write a bench's figures as JSON to `path` (no-op when empty), creating its folder."""
    if not path:
        return
    import json
    from pathlib import Path

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def percentile(values: list[float], q: float) -> float:
    """The value at quantile `q` of `values` (nearest rank; `values` must not be empty)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]
