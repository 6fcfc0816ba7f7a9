"""Speculative decoding's figures in one run: MTP draft acceptance, and tokens/s with and without.

`measure_speculation` gives a model k MTP modules (fresh, unless it already has them), self-distils
them on the model's own samples (`mtp_distill.distill_on_own_samples`: a corpus generated from
`corpus_prompts`, the held-out KL measured before and after on samples of `prompts`), then decodes `prompts`
with a plain engine and a speculative one over the same weights, same requests, alternating which
goes first over the repeats; the figures are medians over repeats. Tokens/s counts generated
tokens over the wall time of all requests (prefill included); the acceptance rate is accepted
drafts over drafted ones. `slipstream bench engine` calls it; any front end or test can.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from slipstream.engine.engine import TorchEngine
from slipstream.engine.interface import GenerationRequest, SamplingParams
from slipstream.engine.model import CausalLM
from slipstream.engine.mtp_distill import distill_on_own_samples
from slipstream.engine.tokenizer import Tokenizer


def _decode(
    engine: TorchEngine, prompts: Sequence[Sequence[int]], params: SamplingParams, tag: str
) -> dict[str, float]:
    """Run every prompt to completion on `engine` (its synchronous core); figures of that run."""
    before = engine.stats()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.submit(GenerationRequest(request_id=f"{tag}/{i}", prompt_ids=list(p), params=params))
    made = 0
    while engine.has_work:
        made += sum(len(r.completion_ids) for r in engine.step())
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    wall = time.perf_counter() - t0
    after = engine.stats()
    drafted = after["spec_drafted_tokens"] - before["spec_drafted_tokens"]
    accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    return {
        "tokens": made,
        "tok_s": made / wall,
        "steps": after["steps"] - before["steps"],
        "drafted": drafted,
        "accepted": accepted,
    }


def _compare(
    engines: dict[str, TorchEngine], prompts: Sequence[Sequence[int]], temperature: float, new_tokens: int, repeats: int
) -> dict[str, Any]:
    """Plain against speculative decoding of `prompts` at one temperature: medians over repeats."""
    params = SamplingParams(temperature=temperature, max_tokens=new_tokens, ignore_eos=True)
    warm = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    for name, engine in engines.items():  # warm-up: one-off allocations and weight packing
        _decode(engine, prompts[:2], warm, f"warm/{name}")
    pairs: list[dict[str, dict[str, float]]] = []
    load_avg = os.getloadavg()[0]  # timings on a shared machine mean little without it
    for rep in range(repeats):
        order = ("plain", "speculative") if rep % 2 == 0 else ("speculative", "plain")
        pairs.append({name: _decode(engines[name], prompts, params, f"{temperature}/{rep}/{name}") for name in order})
    drafted = sum(p["speculative"]["drafted"] for p in pairs)
    accepted = sum(p["speculative"]["accepted"] for p in pairs)
    batch = len(prompts)
    return {
        "temperature": temperature,
        "batch": batch,
        "new_tokens": new_tokens,
        "plain_tok_s": statistics.median(p["plain"]["tok_s"] for p in pairs),
        "speculative_tok_s": statistics.median(p["speculative"]["tok_s"] for p in pairs),
        "speedup": statistics.median(p["speculative"]["tok_s"] / p["plain"]["tok_s"] for p in pairs),
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "load_avg": load_avg,
        # Tokens each row gained per engine step (prefill step included): 1 for plain decoding.
        "tokens_per_row_step_plain": statistics.median(
            p["plain"]["tokens"] / p["plain"]["steps"] / batch for p in pairs
        ),
        "tokens_per_row_step_speculative": statistics.median(
            p["speculative"]["tokens"] / p["speculative"]["steps"] / batch for p in pairs
        ),
        "repeats": pairs,
    }


def measure_speculation(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    corpus_prompts: Sequence[Sequence[int]],
    *,
    k: int = 3,
    batches: Sequence[int] = (),
    new_tokens: int = 48,
    temperatures: Sequence[float] = (0.0, 0.7),
    distill_steps: int = 300,
    distill_lr: float = 3e-3,
    distill_batch: int = 16,
    distill_positions: int = 0,
    corpus_samples: int = 4,
    corpus_tokens: int = 96,
    repeats: int = 3,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> dict[str, Any]:
    """Distil k MTP modules on the model's own samples, then time plain and speculative decoding
    of the first `batch` of `prompts` (one request each, `new_tokens` each, eos ignored) for each
    batch size (default: all the prompts at once) and temperature."""
    if k < 1:
        raise ValueError(f"measure_speculation: k must be >= 1, got {k}")
    if not prompts or not corpus_prompts:
        raise ValueError("measure_speculation: needs prompts to decode and prompts to build the corpus from")
    device = torch.device(device)
    model = model.to(device=device, dtype=dtype)
    distill = distill_on_own_samples(
        model,
        tokenizer,
        corpus_prompts,
        prompts,
        depth=k,
        steps=distill_steps,
        lr=distill_lr,
        batch_size=distill_batch,
        positions_per_step=distill_positions,
        samples_per_prompt=corpus_samples,
        max_tokens=corpus_tokens,
        seed=seed,
    )
    longest = max(len(p) for p in prompts)
    rows: list[dict[str, Any]] = []
    for batch in batches or [len(prompts)]:
        if not 1 <= batch <= len(prompts):
            raise ValueError(f"measure_speculation: batch {batch} needs 1..{len(prompts)} prompts")
        engines = {
            name: TorchEngine(
                model,
                tokenizer,
                max_batch=batch,
                max_seq_len=longest + new_tokens + 1,
                device=device,
                dtype=dtype,
                seed=seed,
                speculative_tokens=spec,
            )
            for name, spec in (("plain", 0), ("speculative", k))
        }
        for temperature in temperatures:
            rows.append(_compare(engines, prompts[:batch], temperature, new_tokens, repeats))
    return {
        "k": k,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "distill": distill,
        "rows": rows,
    }
