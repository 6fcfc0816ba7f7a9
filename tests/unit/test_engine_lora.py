"""LoRA: adapters on a frozen base; version 0 is the base, a step trains only adapters, versions are adapters only
(on the dense tiny preset and on tiny-moe, whose experts' projections carry adapters too)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection

from slipstream.engine import GenerationRequest, SamplingParams, TorchEngine, build_tiny
from slipstream.engine.lora import LoraLinear, adapter_state, attach_lora, merged_weight
from slipstream.engine.source import ModelSource, load_model
from slipstream.learner.config import LearnerSection
from slipstream.learner.trainer import Trainer
from slipstream.learner.version_state import unique_state
from slipstream.rl import LossConfig
from slipstream.schemas import (
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    Trajectory,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
)

pytestmark = pytest.mark.unit

PROMPT = [257, 50, 51, 52]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _scored(tid: str, completion: list[int], reward: float) -> ScoredEpisode:
    n = len(completion)
    traj = Trajectory(
        trajectory_id=tid,
        task_id="t",
        env="arith",
        group_id="t/g",
        group_size=2,
        prompt_len=len(PROMPT),
        token_ids=pack_ids(PROMPT + completion),
        logprobs=pack_floats([-math.log(259.0)] * n),
        loss_mask=pack_mask([1] * n),
        segments=[PolicySegment(0, n)],
    )
    return scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0))


def test_version_zero_is_the_base_and_only_adapters_train() -> None:
    base, _ = build_tiny("tiny", seed=3)
    model, _ = build_tiny("tiny", seed=3)
    wrapped = attach_lora(model, rank=4, alpha=8.0, targets=["q_proj", "down_proj"], seed=0)
    layers = model.config.num_hidden_layers
    assert len(wrapped) == 2 * layers
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert len(trainable) == 4 * layers and all(n.endswith((".lora_A", ".lora_B")) for n in trainable)
    assert "model.layers.0.self_attn.q_proj.weight" in dict(model.named_parameters())  # HF name kept
    ids = torch.tensor([[257, 10, 20, 30, 40]])
    with torch.no_grad():
        assert torch.equal(model(ids), base(ids))  # B = 0
    # Same seed, same A: every process builds an identical version 0.
    again, _ = build_tiny("tiny", seed=3)
    attach_lora(again, rank=4, alpha=8.0, targets=["q_proj", "down_proj"], seed=0)
    for name, t in adapter_state(model).items():
        assert torch.equal(t, adapter_state(again)[name]), name


def test_lora_forward_equals_the_merged_weight() -> None:
    model, _ = build_tiny("tiny", seed=0)
    attach_lora(model, rank=2, alpha=4.0, targets=["v_proj"], seed=1)
    layer = model.decoder_layers[0].self_attn.v_proj
    assert isinstance(layer, LoraLinear) and layer.scale == 2.0
    with torch.no_grad():
        layer.lora_B.normal_(0.0, 0.1)
    x = torch.randn(3, layer.in_features)
    expected = x @ merged_weight(layer).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_bad_targets_and_double_attach_are_refused() -> None:
    model, _ = build_tiny("tiny", seed=0)
    with pytest.raises(ValueError, match=r"\['qproj'\] match no linear"):
        attach_lora(model, rank=2, alpha=4.0, targets=["qproj"])
    model, _ = build_tiny("tiny", seed=0)
    attach_lora(model, rank=2, alpha=4.0, targets=["q_proj"])
    with pytest.raises(ValueError, match="already has LoRA"):
        attach_lora(model, rank=2, alpha=4.0, targets=["q_proj"])
    with pytest.raises(ValueError, match="LoRA needs"):
        ModelSource(lora_rank=4, lora_targets=[])


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_a_lora_step_moves_adapters_only_and_a_version_is_the_adapters(preset: str) -> None:
    model, tok = load_model(ModelSource(preset=preset, lora_rank=4, lora_alpha=8.0, threads=0))
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    before = {n: t.detach().clone() for n, t in adapter_state(model).items()}
    trainer = Trainer(model, LearnerSection(lr=1e-2), LossConfig(), pad_id=tok.pad_id)
    group = [_scored("a", [60, 61, 258], 1.0), _scored("b", [70, 71, 258], 0.0)]
    stats = trainer.step([group], version=0)
    assert stats.applied and stats.grad_norm > 0
    for name, p in model.named_parameters():
        if name in base:
            assert torch.equal(p, base[name]), name
    moved = [n for n, t in adapter_state(model).items() if not torch.equal(t, before[n])]
    assert any(n.endswith("lora_B") for n in moved)
    if preset == "tiny-moe":  # the experts' projections carry adapters too, and the routed ones train
        assert any(".experts." in n and n.endswith("lora_B") for n in moved)
    state = unique_state(model)
    assert sorted(state) == sorted(adapter_state(model))
    full = sum(p.numel() for p in model.parameters())
    assert sum(t.numel() for t in state.values()) < full / 10
    # The optimizer holds the adapters only (so does its checkpointed state).
    assert sum(len(g["params"]) for g in trainer.optimizer.param_groups) == len(state)


@pytest.mark.parametrize("preset", ["tiny", "tiny-moe"])
def test_engine_applies_adapter_versions_in_flight(preset: str) -> None:
    source = ModelSource(preset=preset, lora_rank=4, lora_alpha=8.0, threads=0)
    trained, tok = load_model(source)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(5)
        for name, t in adapter_state(trained).items():
            if name.endswith("lora_B"):
                t.normal_(0.0, 0.5, generator=gen)
    serving, _ = load_model(source)
    prompt = [257, *tok.encode("12+7=")]

    async def greedy(version: int | None) -> list[int]:
        engine = TorchEngine(serving, tok, max_batch=2, allow_partial_updates=True)
        await engine.start()
        try:
            if version is not None:
                engine.apply_weights(version, {n: t.detach().clone() for n, t in unique_state(trained).items()})
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            result = await engine.generate(GenerationRequest(request_id="r", prompt_ids=prompt, params=params))
            assert [v for v, _ in result.segments] == [version or 0]
            return list(result.completion_ids)
        finally:
            await engine.stop()

    before = asyncio.run(greedy(None))
    after = asyncio.run(greedy(1))
    ids = torch.tensor([prompt])
    want: list[int] = []
    with torch.no_grad():
        for _ in range(6):
            nxt = int(trained(ids)[0, -1].argmax())
            want.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    assert after == want
    assert before != after
