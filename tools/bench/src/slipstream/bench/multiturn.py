"""`slipstream bench multiturn`: multi-turn episodes with the KV cache kept between turns vs re-prefilled.

An episode of T turns: a prompt, then per turn the engine generates `--gen` tokens and the
environment appends an observation of `--obs` tokens, so turn t's prompt is everything before it
(256 tokens a turn with the defaults: a 64-token tool call, then a 192-token tool result).
`--episodes` episodes run concurrently through the
engine's async face, as a rollout worker runs a group. The same episodes run twice on one engine
configuration, once with a `session_id` per episode (the engine keeps its cache slot between
turns and prefills only the new tokens) and once without (every turn re-prefills the whole
context: the baseline). Both modes alternate within each repeat, on the same model and prompts,
and the figure is the median over repeats of each pair's ratio. Target: >= 2x at 8 turns.
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
        "multiturn",
        help="tokens/s of multi-turn episodes with the KV cache kept between turns vs re-prefilled",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--preset", default="25m", help="model preset (default 25m)")
    p.add_argument("--turns", type=int, nargs="+", default=[2, 4, 8], help="turns per episode (default 2 4 8)")
    p.add_argument("--gen", type=int, default=64, help="tokens generated per turn: a tool call (default 64)")
    p.add_argument("--obs", type=int, default=192, help="observation tokens per turn: its result (default 192)")
    p.add_argument("--episodes", type=int, default=8, help="episodes run concurrently: one group (default 8)")
    p.add_argument("--repeats", type=int, default=3, help="repeats per turn count; medians reported (default 3)")
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default 1, as rollout workers run: [model] threads)"
    )
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2))
        print(f"wrote {path}")
    return 0


async def _play(engine: Any, tok: Any, *, episodes: int, turns: int, gen: int, obs: int, kept: bool, tag: str) -> int:
    from slipstream.engine.interface import GenerationRequest, SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=gen, ignore_eos=True, seed=7)
    observation = tok.encode(("<result>17</result> next? " * obs)[:obs])

    async def one(e: int) -> int:
        context = tok.encode((f"task {e}: add the numbers " * obs)[:obs])
        made = 0
        session = f"{tag}/{e}" if kept else ""
        for t in range(turns):
            request = GenerationRequest(
                request_id=f"{tag}/{e}/{t}", prompt_ids=context, params=params, session_id=session
            )
            result = await engine.generate(request)
            made += len(result.completion_ids)
            context = [*context, *result.completion_ids, *observation]
        engine.release(session)
        return made

    return sum(await asyncio.gather(*(one(e) for e in range(episodes))))


async def _measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.presets import build_tiny

    if args.threads:
        torch.set_num_threads(args.threads)
    model, tok = build_tiny(args.preset, seed=0)
    longest = max(args.turns) * (args.gen + args.obs) + args.obs + 8
    engine = TorchEngine(model, tok, max_batch=args.episodes, max_seq_len=longest, device="cpu")
    rows: list[dict[str, Any]] = []
    await engine.start()
    try:
        await _play(engine, tok, episodes=1, turns=2, gen=8, obs=8, kept=True, tag="warm")
        for turns in args.turns:
            pairs: list[dict[str, float]] = []
            for rep in range(args.repeats):
                timing: dict[str, float] = {}
                # Alternate which mode goes first so a drift in machine load favours neither.
                order = ("kept", "reprefill") if rep % 2 == 0 else ("reprefill", "kept")
                for mode in order:
                    before = engine.stats()
                    t0 = time.perf_counter()
                    made = await _play(
                        engine,
                        tok,
                        episodes=args.episodes,
                        turns=turns,
                        gen=args.gen,
                        obs=args.obs,
                        kept=mode == "kept",
                        tag=f"{mode}/{turns}/{rep}",
                    )
                    wall = time.perf_counter() - t0
                    after = engine.stats()
                    timing[f"{mode}_tok_s"] = made / wall
                    timing[f"{mode}_prefill_tokens"] = after["prefill_tokens"] - before["prefill_tokens"]
                    timing[f"{mode}_wall_s"] = wall
                timing["ratio"] = timing["kept_tok_s"] / timing["reprefill_tok_s"]
                pairs.append(timing)
            row = {
                "turns": turns,
                "tokens_per_turn": args.gen + args.obs,
                "kept_tok_s": statistics.median(p["kept_tok_s"] for p in pairs),
                "reprefill_tok_s": statistics.median(p["reprefill_tok_s"] for p in pairs),
                "ratio": statistics.median(p["ratio"] for p in pairs),
                "kept_prefill_tokens": pairs[0]["kept_prefill_tokens"],
                "reprefill_prefill_tokens": pairs[0]["reprefill_prefill_tokens"],
                "repeats": pairs,
            }
            rows.append(row)
            print(
                f"{turns} turns x {row['tokens_per_turn']} tokens, {args.episodes} episodes: "
                f"kept {row['kept_tok_s']:.1f} tok/s, re-prefilled {row['reprefill_tok_s']:.1f} tok/s, "
                f"ratio {row['ratio']:.2f}x (prefilled {row['kept_prefill_tokens']:.0f} vs "
                f"{row['reprefill_prefill_tokens']:.0f} tokens)",
                flush=True,
            )
    finally:
        await engine.stop()
    at8 = next((r["ratio"] for r in rows if r["turns"] == 8), None)
    return {
        "bench": "multiturn",
        "preset": args.preset,
        "episodes": args.episodes,
        "gen_tokens_per_turn": args.gen,
        "obs_tokens_per_turn": args.obs,
        "torch_threads": torch.get_num_threads(),
        "rows": rows,
        "target": {"turns": 8, "ratio": 2.0, "met": None if at8 is None else at8 >= 2.0},
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    result = asyncio.run(_measure(args))
    met = result["target"]["met"]
    if met is not None:
        print(f"target >= 2.0x at 8 turns: {'met' if met else 'NOT met'}")
    return result
