"""The torch engine on the tier's device in bf16: greedy tokens against a reference forward, finite
log-probs, an in-flight weight update, and its decode throughput."""

from __future__ import annotations

import asyncio
import math
import time

import pytest
import torch
from gpu_tier import Figures, Sizes, mfu, mfu_text

from slipstream.engine import CausalLM, GenerationRequest, GenerationResult, SamplingParams, TorchEngine, build_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# A bf16 reference forward over the whole sequence and the engine's cached decode sum in different
# orders, so two near-equal top logits may swap. A mismatch is accepted only where the reference's
# own top two logits are this close; anything else is a wrong token.
TIE_TOLERANCE = 0.0625


def _engine(model: CausalLM, device: str, sizes: Sizes) -> TorchEngine:
    tok = build_tiny(sizes.preset)[1]
    return TorchEngine(
        model,
        tok,
        device=device,
        dtype=torch.bfloat16,
        max_batch=sizes.engine_requests,
        max_seq_len=sizes.prompt_len + sizes.new_tokens + 8,
        bf16_upcast=False,  # the same native bf16 kernels as the reference forward
    )


def _requests(sizes: Sizes, prefix: str = "r") -> list[GenerationRequest]:
    gen = torch.Generator().manual_seed(7)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.new_tokens, ignore_eos=True)
    return [
        GenerationRequest(
            request_id=f"{prefix}{i}",
            prompt_ids=torch.randint(3, 259, (sizes.prompt_len,), generator=gen).tolist(),
            params=params,
        )
        for i in range(sizes.engine_requests)
    ]


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def _timed(engine: TorchEngine, requests: list[GenerationRequest]) -> tuple[list[GenerationResult], float]:
    start = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in requests))
    _sync(engine.device.type)
    return list(results), time.perf_counter() - start


async def _with_update(
    engine: TorchEngine, requests: list[GenerationRequest], after_tokens: int, update: dict[str, torch.Tensor]
) -> list[GenerationResult]:
    """Run `requests`, queueing `update` as version 1 once the engine has generated `after_tokens` more."""
    pending = [asyncio.ensure_future(engine.generate(r)) for r in requests]
    target = engine.stats()["tokens_generated"] + after_tokens
    while engine.stats()["tokens_generated"] < target:
        await asyncio.sleep(0.001)
    engine.apply_weights(1, update)
    return list(await asyncio.gather(*pending))


def _check_against_reference(model: CausalLM, result: GenerationResult) -> int:
    """Teacher-forced reference over prompt + completion; returns how many tokens were near-ties."""
    ids = torch.tensor([result.prompt_ids + result.completion_ids], device=next(model.parameters()).device)
    with torch.no_grad():
        logits = model(ids)[0, len(result.prompt_ids) - 1 : -1].float()
    ties = 0
    for i, token in enumerate(result.completion_ids):
        row = logits[i]
        best = int(row.argmax())
        if best != token:
            gap = float(row[best] - row[token])
            assert gap <= TIE_TOLERANCE, (
                f"{result.request_id} token {i}: engine chose {token}, reference argmax {best} "
                f"leads by {gap:.4f} (> tie tolerance {TIE_TOLERANCE})"
            )
            ties += 1
    return ties


def test_bf16_engine_greedy_equals_reference_and_applies_an_update(
    tier_device: str, sizes: Sizes, figures: Figures
) -> None:
    model, _ = build_tiny(sizes.preset, seed=1, dtype=torch.bfloat16, device=tier_device)
    n_params = sum(p.numel() for p in model.parameters())
    engine = _engine(model.eval(), tier_device, sizes)
    new, _ = build_tiny(sizes.preset, seed=2, dtype=torch.bfloat16, device=tier_device)
    update = {k: v.detach().clone() for k, v in new.state_dict().items()}

    async def run() -> tuple[list[GenerationResult], float, list[GenerationResult]]:
        await engine.start()
        try:
            await _timed(engine, _requests(sizes, "warm"))  # first-use kernels and allocator, not timed
            results, seconds = await _timed(engine, _requests(sizes))
            updated = await _with_update(engine, _requests(sizes, "u"), sizes.engine_requests * 4, update)
            return results, seconds, updated
        finally:
            await engine.stop()

    results, seconds, updated = asyncio.run(run())

    # Greedy under the first weights: the reference forward's argmax, finite log-probs. (The update
    # copied new weights into the engine's model since, so the reference is the seed-1 model rebuilt.)
    reference, _ = build_tiny(sizes.preset, seed=1, dtype=torch.bfloat16, device=tier_device)
    ties = 0
    for res in results:
        assert len(res.completion_ids) == sizes.new_tokens and res.finish_reason == "length"
        assert len(res.logprobs) == sizes.new_tokens
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in res.logprobs), res.request_id
        ties += _check_against_reference(reference.eval(), res)
    generated = sum(len(r.completion_ids) for r in results)
    assert ties <= generated // 20, f"{ties} of {generated} tokens were near-ties: the engine is off the reference"

    # In-flight update: queued while the "u" requests ran; their later tokens carry the new version,
    # and the engine's weights end up exactly the update's.
    assert engine.policy_version == 1
    for res in updated:
        versions = res.policy_versions
        assert versions[0] == 0 and versions[-1] == 1, (res.request_id, res.segments)
        assert all(math.isfinite(lp) for lp in res.logprobs)
    for name, value in update.items():
        assert torch.equal(engine.state_dict()[name], value), name

    # Generation FLOPs ~ 2 x parameters per token (attention over the short context left out).
    share = mfu(2.0 * n_params * generated, seconds, figures.peak)
    figures.record(
        "engine_bf16",
        preset=sizes.preset,
        params=n_params,
        requests=sizes.engine_requests,
        prompt_len=sizes.prompt_len,
        new_tokens=sizes.new_tokens,
        generated_tokens=generated,
        seconds=seconds,
        tokens_per_s=generated / seconds,
        mfu=share,
        mfu_text=mfu_text(share),
        near_ties=ties,
    )
