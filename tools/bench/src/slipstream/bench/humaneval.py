"""`slipstream bench humaneval`: HumanEval pass@1 in completion mode, graded by the hardened grader.

No tool protocol: the model gets a problem's prompt (signature and docstring, stripped of its
trailing newline as bigcode-evaluation-harness does) as plain text and continues it; the
completion is cut at the first line that starts a new top-level block (Codex's stop strings
`\\ndef`, `\\nclass`, `\\nif`, `\\nprint`, `\\n#`), capped at `--max-new` tokens.
`prompt + completion` becomes `solution.py` and goes through `HumanEval.grade`, the same grader
the `code` env's rewards use (libs/envs code/grader.py: the agent's function is called in a
sandbox by value, the problem's `check` runs in a second sandbox that never loads the agent's
code). Greedy decoding gives pass@1; `--samples K` adds K samples a problem at `--temperature`
(the unbiased pass@1 estimate is then the mean pass rate over samples).

Generation runs through the project's engine (`TorchEngine`), `--batch` requests in flight.
Models: a catalog name (`smollm2-135m`), a local HF directory, or `tiny` (the byte-level preset
the CPU demo trains, randomly initialised with `--seed`: a floor, not a result).
`--completions FILE` keeps the completions as JSON lines; given an existing file the bench
grades it without generating (so generating and grading can run apart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

STOPS = ["\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#"]


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "humaneval",
        help="HumanEval pass@1, completion mode (prompt -> body), through the hardened code grader",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="smollm2-135m", help="catalog name, HF directory, or 'tiny' (default smollm2)")
    p.add_argument("--problems", type=int, default=164, help="problems 0..N-1 (default all 164)")
    p.add_argument("--max-new", type=int, default=256, help="most tokens a completion may have (default 256)")
    p.add_argument("--batch", type=int, default=16, help="requests in flight in the engine (default 16)")
    p.add_argument("--samples", type=int, default=0, help="sampled completions per problem besides greedy")
    p.add_argument("--temperature", type=float, default=0.8, help="temperature of the samples (default 0.8)")
    p.add_argument("--seed", type=int, default=0, help="engine seed (and the tiny model's init)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    p.add_argument("--completions", default="", metavar="FILE", help="JSON lines of completions: read or write")
    p.add_argument("--json", default="", metavar="FILE", help="write the results as JSON to FILE")
    p.add_argument("--generate-only", action="store_true", help="write --completions and stop (grade later)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    from slipstream.bench.main import write_json

    if not 0 < args.problems <= 164:
        raise SystemExit(f"--problems must be 1..164, got {args.problems}")
    if args.max_new < 1 or args.batch < 1 or args.samples < 0:
        raise SystemExit(f"--max-new and --batch must be >= 1 and --samples >= 0 ({args.max_new}, {args.batch})")
    cache = Path(args.completions) if args.completions else None
    if cache is not None and cache.is_file():
        rows = [json.loads(line) for line in cache.read_text().splitlines() if line.strip()]
        print(f"grading {len(rows)} completions from {cache}")
        gen_info: dict[str, Any] = {"from": str(cache)}
    else:
        rows, gen_info = asyncio.run(_generate(args))
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text("".join(json.dumps(r) + "\n" for r in rows))
            print(f"wrote {cache}")
        if args.generate_only:
            return 0
    result = {"model": args.model, "generation": gen_info, **grade_rows(rows)}
    for mode in ("greedy", "sampled"):
        if mode in result:
            m = result[mode]
            print(f"{mode:8} pass@1 {m['pass_at_1']:.4f} ({m['passed']}/{m['graded']} completions)")
    write_json(result, args.json)
    return 0


def truncate(text: str) -> str:
    """The completion up to the first stop string (a new top-level block)."""
    cut = len(text)
    for stop in STOPS:
        at = text.find(stop)
        if at != -1:
            cut = min(cut, at)
    return text[:cut]


async def _generate(args: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    import torch

    from slipstream.engine.engine import TorchEngine
    from slipstream.engine.interface import GenerationRequest, SamplingParams
    from slipstream.envs.code.tasks import humaneval_problems

    if args.threads:
        torch.set_num_threads(args.threads)
    model: Any
    tok: Any
    if args.model == "tiny":
        from slipstream.engine.presets import build_tiny

        model, tok = build_tiny("tiny", seed=args.seed)
    else:
        from slipstream.engine.catalog import ensure_model
        from slipstream.engine.loading import load_pretrained

        directory = Path(args.model) if Path(args.model).is_dir() else ensure_model(args.model)
        model, tok = load_pretrained(directory, dtype=torch.float32)
    problems = humaneval_problems()
    # The prompt without its trailing newline (bigcode-evaluation-harness's default): a prompt that
    # ends in a bare "\n" token is out of distribution for a BPE model, which then starts a new
    # top-level block (SmolLM2: 101 of 164 greedy completions cut to nothing at "\ndef"/"\n#").
    prompts = [(n, problems[f"HumanEval/{n}"]["prompt"].strip()) for n in range(args.problems)]
    encoded = [tok.encode(p) for _, p in prompts]
    longest = max(len(e) for e in encoded)
    engine = TorchEngine(model, tok, max_batch=args.batch, max_seq_len=longest + args.max_new + 8, seed=args.seed)
    await engine.start()
    gate = asyncio.Semaphore(args.batch)
    started = time.monotonic()
    tokens = 0

    async def one(n: int, ids: list[int], sample: int) -> dict[str, Any]:
        nonlocal tokens
        greedy = sample < 0
        params = SamplingParams(
            temperature=0.0 if greedy else args.temperature,
            max_tokens=args.max_new,
            stop=STOPS,
            seed=None if greedy else args.seed * 100_003 + n * 101 + sample,
        )
        async with gate:
            out = await engine.generate(GenerationRequest(request_id=f"he/{n}/{sample}", prompt_ids=ids, params=params))
        tokens += len(out.completion_ids)
        text = truncate(tok.decode(out.completion_ids))
        mode = "greedy" if greedy else "sampled"
        return {"problem": n, "mode": mode, "sample": sample, "stripped": True, "completion": text}

    try:
        jobs = [one(n, ids, s) for (n, _), ids in zip(prompts, encoded, strict=True) for s in range(-1, args.samples)]
        rows = list(await asyncio.gather(*jobs))
    finally:
        await engine.stop()
    wall = time.monotonic() - started
    info = {"tokens": tokens, "wall_s": round(wall, 1), "tok_s": round(tokens / wall, 1), "max_new": args.max_new}
    print(f"generated {len(rows)} completions, {tokens} tokens in {wall:.0f} s ({tokens / wall:.1f} tok/s)")
    return rows, info


def grade_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Each completion through `HumanEval.grade` (prompt + completion as solution.py); pass@1 per mode."""
    from slipstream.envs.base import TaskSpec
    from slipstream.envs.code.tasks import humaneval_problems, humaneval_task
    from slipstream.envs.registry import get_env

    env = get_env("humaneval")
    problems = humaneval_problems()
    out: dict[str, Any] = {}
    started = time.monotonic()
    for row in rows:
        n = row["problem"]
        task = humaneval_task(f"humaneval:{n}")
        spec = TaskSpec(
            task_id=f"he-{n}", env="humaneval", prompt=task.prompt, reference=task.reference, seed=0, split="heldout"
        )
        prompt = problems[f"HumanEval/{n}"]["prompt"]
        solution = (prompt.strip() if row.get("stripped") else prompt) + row["completion"]
        score = env.grade(spec, json.dumps({"solution.py": solution}))
        row["passed"], row["reason"] = bool(score.correct), score.reason
        mode = out.setdefault(row["mode"], {"graded": 0, "passed": 0, "solved": []})
        mode["graded"] += 1
        mode["passed"] += int(score.correct)
        if score.correct:
            mode["solved"].append(n)
    for mode in out.values():
        mode["pass_at_1"] = mode["passed"] / mode["graded"]
        mode["solved"] = sorted(set(mode["solved"]))
    out["grade_wall_s"] = round(time.monotonic() - started, 1)
    return out
