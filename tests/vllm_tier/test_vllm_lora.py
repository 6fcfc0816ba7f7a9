"""`VllmEngine` in a LoRA run: a version of adapters only is merged into the served weights.

The tiny preset as a checkpoint, LoRA rank 4 on every default target with B drawn at random (B = 0 would
serve the base unchanged): after the adapters-only version, vLLM's greedy tokens and their log-probs are
those of the project's own model carrying the same adapters (`LoraLinear`, unmerged), and the version
after it (B = 0 again) serves the base model's tokens. Prints the apply times (run with -s).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
from conftest import THREADS, VLLM_PYTHON

from slipstream.engine import GenerationRequest, SamplingParams, load_pretrained
from slipstream.engine.lora import DEFAULT_TARGETS, LoraLinear, adapter_state, attach_lora
from slipstream.engine.source import ModelSource
from slipstream.engine.vllm_engine import VllmEngine
from slipstream.engine.vllm_setup import model_dir_for

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1200)]

RANK, ALPHA = 4, 8.0


def _greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    ids, logprobs = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            row = torch.log_softmax(model(torch.tensor([ids]))[0, -1].float(), dim=-1)
            token = int(row.argmax())
            ids.append(token)
            logprobs.append(float(row[token]))
    return ids[len(prompt) :], logprobs


async def _switch(engine: VllmEngine, version: int, tensors: dict[str, torch.Tensor]) -> float:
    t0 = time.perf_counter()
    engine.apply_weights(version, tensors)
    while engine.policy_version != version:
        assert time.perf_counter() - t0 < 300, engine.last_update_error
        await asyncio.sleep(0.01)
    return round(time.perf_counter() - t0, 2)


async def test_an_adapters_only_version_serves_the_lora_models_greedy_tokens(tmp_path: Path) -> None:
    directory = await asyncio.to_thread(model_dir_for, ModelSource(preset="tiny", seed=0, cache_dir=str(tmp_path)))
    engine = VllmEngine(
        directory,
        python=VLLM_PYTHON,
        threads=THREADS,
        max_model_len=512,
        lora_rank=RANK,
        lora_alpha=ALPHA,
        lora_targets=DEFAULT_TARGETS,
    )
    model, tok = await asyncio.to_thread(load_pretrained, directory, torch.float32)
    base, _ = await asyncio.to_thread(load_pretrained, directory, torch.float32)
    wrapped = attach_lora(model, rank=RANK, alpha=ALPHA, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name in wrapped:
            layer = model.get_submodule(name)
            assert isinstance(layer, LoraLinear)
            layer.lora_B.copy_(torch.randn(layer.lora_B.shape, generator=generator) * 0.2)
    adapters = {n: t.detach().clone() for n, t in adapter_state(model).items()}
    prompt = tok.encode("the quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want_lora, want_lora_lp = _greedy(model, prompt, 12)
    want_base, _ = _greedy(base, prompt, 12)
    assert want_lora != want_base  # the adapters change what is served, or this test proves nothing

    await engine.start()
    try:
        first = await _switch(engine, 1, adapters)
        res = await engine.generate(GenerationRequest(request_id="lora", prompt_ids=prompt, params=params))
        assert res.segments == [(1, 12)]
        assert res.completion_ids == want_lora, (res.completion_ids, want_lora)
        assert res.logprobs == pytest.approx(want_lora_lp, abs=1e-3)
        assert engine.stats()["last_lora_merge_ms"] > 0.0
        zeros = {n: (torch.zeros_like(t) if n.endswith(".lora_B") else t) for n, t in adapters.items()}
        second = await _switch(engine, 2, zeros)
        res = await engine.generate(GenerationRequest(request_id="base", prompt_ids=prompt, params=params))
        assert res.completion_ids == want_base
        stats = engine.stats()
        print(
            f"\nvLLM LoRA (tiny, rank {RANK}, {len(wrapped)} modules): versions applied in {first} and {second} s "
            f"(last: apply {stats['last_weight_apply_ms']:.0f} ms, merge {stats['last_lora_merge_ms']:.0f} ms, "
            f"wait {stats['update_wait_ms']:.0f} ms); started in {stats['start_s']:.1f} s"
        )
    finally:
        await engine.stop()
