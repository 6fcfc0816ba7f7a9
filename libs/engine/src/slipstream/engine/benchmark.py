"""Engine throughput benchmark: decode tokens/s of TorchEngine for a preset and batch sizes.

    python -m slipstream.engine.benchmark --preset tiny --max-batch 16 32 --json out.json

Runs the async face (start/generate/stop), as a rollout worker does, with 2 x max_batch
requests of fixed length (eos ignored) so every figure measures the same amount of work; one
weight update lands mid-run so its pause is reported too. Prints one line per batch size and
writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

import torch

from slipstream.engine.engine import TorchEngine
from slipstream.engine.interface import GenerationRequest, SamplingParams
from slipstream.engine.model import count_parameters
from slipstream.engine.presets import build_tiny


async def _measure(
    preset: str, max_batch: int, requests: int, prompt_len: int, max_tokens: int, device: str
) -> dict[str, Any]:
    model, tok = build_tiny(preset, seed=0)
    engine = TorchEngine(model, tok, max_batch=max_batch, max_seq_len=prompt_len + max_tokens + 1, device=device)
    update = {k: v.clone() for k, v in engine.state_dict().items()}
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = tok.encode(("12+34=" * prompt_len)[:prompt_len])
    await engine.start()
    try:
        # Warm-up: first forwards pay one-off allocation costs.
        await engine.generate(GenerationRequest(request_id="warm", prompt_ids=prompt, params=params))
        t0 = time.perf_counter()
        tasks = [
            asyncio.create_task(
                engine.generate(GenerationRequest(request_id=f"r{i}", prompt_ids=prompt, params=params))
            )
            for i in range(requests)
        ]
        while engine.stats()["tokens_generated"] < max_tokens * (1 + requests // 2):
            await asyncio.sleep(0.005)
        engine.apply_weights(1, update)
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    finally:
        await engine.stop()
    tokens = sum(len(r.completion_ids) for r in results)
    stats = engine.stats()
    return {
        "preset": preset,
        "params": count_parameters(model),
        "device": device,
        "torch_threads": torch.get_num_threads(),
        "max_batch": max_batch,
        "requests": requests,
        "prompt_len": len(prompt),
        "max_tokens": max_tokens,
        "tokens": tokens,
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 1),
        "weight_apply_ms": round(stats["last_weight_apply_ms"], 2),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(prog="python -m slipstream.engine.benchmark", description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--max-batch", type=int, nargs="+", default=[16, 32])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for mb in args.max_batch:
        row = asyncio.run(_measure(args.preset, mb, 2 * mb, args.prompt_len, args.max_tokens, args.device))
        print(
            f"{row['preset']} ({row['params'] / 1e6:.2f}M) {row['device']} threads={row['torch_threads']} "
            f"max_batch={mb}: {row['tokens_per_s']:.0f} tokens/s ({row['tokens']} tokens in {row['wall_s']:.2f} s), "
            f"weight apply {row['weight_apply_ms']:.1f} ms"
        )
        rows.append(row)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return rows


if __name__ == "__main__":
    main()
