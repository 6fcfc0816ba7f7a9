"""`slipstream bench envs`: episodes per second of a verifiers environment vs a native one, same task.

The task is one-digit addition both ways: the native `arith` environment (max_operand 9, `+`:
prompt "a+b=") and the repository's verifiers taskset `vf_sum` (the same question), played by
verifiers' own `null` harness in its venv through the loopback `/inference/v1/generate` route
(libs/envs verifiers). One engine (the tiny preset, one torch thread, as a rollout worker runs)
serves both, and both play `--groups` groups of `--group-size` episodes concurrently through the
harness (`rollout_episodes`) with the same `--max-tokens`. A warm-up group each comes first (the
verifiers runner, its env and its harness program start then). The two alternate within each
repeat, so a drift in machine load favours neither; figures are medians over repeats, and the
ratio is verifiers / native. What it measures: the price of running an environment's own
harness (a program per episode, an MCP-capable chat loop, client-side rendering, HTTP) against
Slipstream's in-process loop, for the same sampled tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[5]


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "envs",
        help="episodes/s through the verifiers route vs a native environment doing the same task",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--python", default=str(REPO / ".venv-vf" / "bin" / "python"), help="verifiers' interpreter")
    p.add_argument("--tasksets", default=str(REPO / "examples" / "verifiers-envs"), help="verifiers taskset dir")
    p.add_argument("--groups", type=int, default=2, help="groups per measurement, played concurrently (default 2)")
    p.add_argument("--group-size", type=int, default=4, help="episodes per group (default 4)")
    p.add_argument("--max-tokens", type=int, default=4, help="tokens sampled per episode at most (default 4)")
    p.add_argument("--repeats", type=int, default=3, help="repeats; medians reported (default 3)")
    p.add_argument("--preset", default="tiny", help="model preset (default tiny)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = asyncio.run(measure(args))
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


async def _play(engine: Any, tok: Any, env: Any, *, groups: int, size: int, max_tokens: int, seed: int) -> int:
    from slipstream.engine.interface import SamplingParams
    from slipstream.harness.rollout import rollout_episodes

    params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
    tasks = env.generate("train", groups, seed=seed)
    played = await asyncio.gather(
        *(rollout_episodes(engine, tok, env, task, group_size=size, params=params) for task in tasks)
    )
    return sum(len(group) for group in played)


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.presets import build_tiny
    from slipstream.envs import get_env
    from slipstream.envs.verifiers.bridge import Bridge

    torch.set_num_threads(1)
    model, tok = build_tiny(args.preset, seed=0)
    engine = TorchEngine(model, tok, max_batch=args.groups * args.group_size, max_seq_len=512, device="cpu")
    envs = {
        "native": get_env("arith", max_operand=9, ops="+"),
        "verifiers": get_env(
            "verifiers",
            python=args.python,
            pythonpath=[args.tasksets],
            env={"taskset": {"id": "vf_sum"}, "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}}},
            tasks=1024,
            sampling={"max_tokens": args.max_tokens},
        ),
    }
    runs: list[dict[str, float]] = []
    await engine.start()
    try:
        for env in envs.values():  # warm-up: the runner, its env and the harness program start here
            await _play(engine, tok, env, groups=1, size=1, max_tokens=args.max_tokens, seed=10_000)
        for rep in range(args.repeats):
            timing: dict[str, float] = {}
            order = ("native", "verifiers") if rep % 2 == 0 else ("verifiers", "native")
            for name in order:
                t0 = time.perf_counter()
                played = await _play(
                    engine,
                    tok,
                    envs[name],
                    groups=args.groups,
                    size=args.group_size,
                    max_tokens=args.max_tokens,
                    seed=rep,
                )
                wall = time.perf_counter() - t0
                timing[f"{name}_episodes_s"] = played / wall
                timing[f"{name}_wall_s"] = wall
            timing["ratio"] = timing["verifiers_episodes_s"] / timing["native_episodes_s"]
            runs.append(timing)
            print(
                f"repeat {rep}: native {timing['native_episodes_s']:.2f} episodes/s, "
                f"verifiers {timing['verifiers_episodes_s']:.2f} episodes/s, ratio {timing['ratio']:.3f}",
                flush=True,
            )
    finally:
        await Bridge.close_all()
        await engine.stop()
    result = {
        "bench": "envs",
        "task": "one-digit addition: arith(max_operand=9, ops='+') vs verifiers vf_sum (null harness)",
        "episodes_per_measurement": args.groups * args.group_size,
        "max_tokens": args.max_tokens,
        "preset": args.preset,
        "native_episodes_s": statistics.median(r["native_episodes_s"] for r in runs),
        "verifiers_episodes_s": statistics.median(r["verifiers_episodes_s"] for r in runs),
        "ratio": statistics.median(r["ratio"] for r in runs),
        "repeats": runs,
    }
    print(
        f"median: native {result['native_episodes_s']:.2f} episodes/s, verifiers "
        f"{result['verifiers_episodes_s']:.2f} episodes/s (verifiers / native {result['ratio']:.3f})"
    )
    return result
