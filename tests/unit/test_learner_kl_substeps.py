"""The learner's KL to a frozen reference (full fine-tune and LoRA) and its substeps, on the tiny model."""

from __future__ import annotations

import asyncio
import math

import pytest
import structlog
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection

from slipstream.bus import BusConfig, connect_bus, reset_memory_brokers
from slipstream.engine import build_tiny
from slipstream.engine.lora import adapter_state
from slipstream.engine.source import ModelSource, load_model
from slipstream.learner.config import LearnerSection
from slipstream.learner.instruments import STEP_KL, STEP_MASKED, STEP_MISMATCH
from slipstream.learner.progress import Progress
from slipstream.learner.report import observe, publish_step
from slipstream.learner.trainer import Trainer, micro_batches, step_items, trained_tokens
from slipstream.rl import LossConfig, token_logprobs
from slipstream.schemas import (
    LearnerStep,
    PolicySegment,
    ScoredEpisode,
    ScoredTrajectory,
    Trajectory,
    pack_floats,
    pack_ids,
    pack_mask,
    scored_episode_from_v1,
)
from slipstream.schemas.subjects import LEARNER_STEP

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

PROMPT = [1, 50, 51, 52]


def behaviour_of(model: torch.nn.Module, completion: list[int]) -> list[float]:
    ids = torch.tensor([PROMPT + completion])
    with torch.no_grad():
        lp = token_logprobs(model(ids)[:, :-1], ids[:, 1:])[0]
    return lp[len(PROMPT) - 1 :].tolist()


def scored(tid: str, completion: list[int], reward: float, behaviour: list[float]) -> ScoredEpisode:
    traj = Trajectory(
        trajectory_id=tid,
        task_id="t",
        env="arith",
        group_id="t/g",
        group_size=2,
        prompt_len=len(PROMPT),
        token_ids=pack_ids(PROMPT + completion),
        logprobs=pack_floats(behaviour),
        loss_mask=pack_mask([1] * len(completion)),
        segments=[PolicySegment(0, len(completion))],
    )
    return scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5))


def on_policy_groups(model: torch.nn.Module) -> list[list[ScoredEpisode]]:
    """Two groups whose behaviour log-probs are `model`'s own (ratio 1 before the first update)."""
    comps = [([60, 61, 62], 1.0), ([70, 71], 0.0), ([80], 0.0), ([81, 82], 1.0)]
    eps = [scored(str(i), c, r, behaviour_of(model, c)) for i, (c, r) in enumerate(comps)]
    return [eps[:2], eps[2:]]


def test_kl_to_the_initial_weights_is_reported_and_the_reference_stays_frozen() -> None:
    model, tok = build_tiny("tiny", seed=0)
    t = Trainer(model, LearnerSection(lr=3e-3), LossConfig(kl_coef=0.1, kl_estimator="k3"), pad_id=tok.pad_id)
    assert t.reference is not None and t.reference.module is not model and not t.reference.shares_policy
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert not any(p.requires_grad for p in t.reference.module.parameters())
    groups = on_policy_groups(model)
    first = t.step(groups, version=0)
    # Before the first update the policy is the reference: k3 is 0 up to float rounding (the no-grad pass
    # may take other kernels), far below the KL one update makes (checked below).
    assert first.applied and abs(first.figures["kl"]) < 1e-10 and abs(first.figures["kl_loss"]) < 1e-12
    stats = [t.step(groups, version=v) for v in (1, 2)]
    kls = [s.figures["kl"] for s in stats]
    assert all(math.isfinite(k) and k > 1e-6 for k in kls)  # the policy left the reference
    assert stats[1].figures["kl_loss"] == pytest.approx(0.1 * kls[1] * stats[1].n_tokens / 1024.0, rel=1e-5)
    ref_state = t.reference.module.state_dict()
    assert all(torch.equal(ref_state[k], v) for k, v in initial.items())  # the reference never moved
    assert sum(not torch.equal(model.state_dict()[k], v) for k, v in initial.items()) == len(initial)  # the policy did


def test_without_kl_there_is_no_reference_and_no_kl_figure() -> None:
    model, tok = build_tiny("tiny", seed=0)
    t = Trainer(model, LearnerSection(), LossConfig(), pad_id=tok.pad_id)
    assert t.reference is None
    stats = t.step(on_policy_groups(model), version=0)
    assert "kl" not in stats.figures and stats.figures["masked_share"] == 0.0


def test_a_lora_reference_is_the_base_model_with_the_adapters_off_and_no_copy() -> None:
    model, tok = load_model(ModelSource(lora_rank=4, lora_alpha=8.0, threads=0))
    t = Trainer(model, LearnerSection(lr=1e-2), LossConfig(kl_coef=0.5, kl_estimator="k1"), pad_id=tok.pad_id)
    assert t.reference is not None and t.reference.module is model and t.reference.shares_policy
    base = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    scales = [layer.scale for layer in t.reference.adapters]
    groups = on_policy_groups(model)
    t.step(groups, version=0)
    moved = t.step(groups, version=1)
    assert math.isfinite(moved.figures["kl"]) and moved.figures["kl"] != 0.0
    assert [layer.scale for layer in t.reference.adapters] == scales  # adapters back on after each reference pass
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if n in base)
    # The reference pass equals the plain base model: zero adapters give the same log-probs.
    ids = torch.tensor([[*PROMPT, 60, 61]])
    with torch.no_grad(), t.reference.active() as ref:
        off = token_logprobs(ref(ids)[:, :-1], ids[:, 1:])
    with torch.no_grad():
        for b in (p for n, p in adapter_state(model).items() if n.endswith("lora_B")):
            b.zero_()
        plain = token_logprobs(model(ids)[:, :-1], ids[:, 1:])
    assert torch.equal(off, plain)


def test_one_substep_is_the_single_update_to_the_bit() -> None:
    runs = []
    for how in ("default", "explicit", "by_hand"):
        model, tok = build_tiny("tiny", seed=4)
        section = LearnerSection(lr=1e-3) if how == "default" else LearnerSection(lr=1e-3, substeps=1)
        t = Trainer(model, section, LossConfig(), pad_id=tok.pad_id)
        groups = on_policy_groups(build_tiny("tiny", seed=9)[0])  # off-policy behaviour: ratios away from 1
        if how == "by_hand":  # what a step did before substeps existed: one accumulate, one apply
            items = step_items(groups, section)
            t.accumulate(micro_batches(items, section.micro_batch), trained_tokens(items))
            t.apply()
        else:
            assert t.step(groups, version=0).substeps == 1
        runs.append([p.detach().clone() for p in model.parameters()])
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))


def test_substeps_update_k_times_each_against_the_behaviour_log_probs() -> None:
    model, tok = build_tiny("tiny", seed=0)
    groups = on_policy_groups(model)
    one = Trainer(build_tiny("tiny", seed=0)[0], LearnerSection(lr=3e-3), LossConfig(), pad_id=tok.pad_id)
    t = Trainer(model, LearnerSection(lr=3e-3, substeps=3), LossConfig(kl_coef=0.05), pad_id=tok.pad_id)
    assert t.reference is not None
    calls = []
    t.reference.module.lm_head.register_forward_hook(lambda *a: calls.append(1))
    s1, s3 = one.step(groups, version=0), t.step(groups, version=0)
    assert s3.applied and s3.substeps == 3 and s1.substeps == 1
    # The first substep is on-policy (ratio 1, no mismatch); the last one's ratio moved away from it.
    assert s3.figures["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert s3.figures["behaviour_kl"] == pytest.approx(0.0, abs=1e-6)
    assert abs(s3.figures["last_ratio_mean"] - 1.0) > 1e-3 and s3.figures["last_behaviour_kl"] > 1e-6
    assert "last_ratio_mean" not in s1.figures
    # Three updates move the rewarded completion further than one.
    good = [60, 61, 62]
    assert sum(behaviour_of(model, good)) > sum(behaviour_of(one.model, good)) + 1e-3
    assert len(calls) == 1  # the reference's log-probs: one pass per micro-batch, reused by later substeps


def test_substeps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="substeps must be >= 1, got 0"):
        LearnerSection(substeps=0)


async def test_kl_mismatch_and_masked_share_reach_the_step_log_the_metrics_and_learner_step() -> None:
    model, tok = build_tiny("tiny", seed=0)
    loss = LossConfig(kl_coef=0.1, off_policy_mask="token", mask_low=0.9, mask_high=1.1)
    t = Trainer(model, LearnerSection(lr=3e-3, substeps=2), loss, pad_id=tok.pad_id)
    groups = on_policy_groups(build_tiny("tiny", seed=7)[0])  # another model's log-probs: a real mismatch
    t.step(groups, version=0)
    stats = t.step(groups, version=1)
    kl, mismatch, masked = stats.figures["kl"], stats.figures["behaviour_kl"], stats.figures["masked_share"]
    assert kl > 1e-6 and mismatch > 1e-3 and 0.0 < masked <= 1.0
    progress = Progress(step=2, version=2)
    with structlog.testing.capture_logs() as logs:
        observe(stats, progress, held=0)
    (line,) = [r for r in logs if r["event"] == "step"]
    assert (line["kl"], line["mismatch_kl"], line["masked_share"], line["substeps"]) == (
        round(kl, 8), round(mismatch, 8), round(masked, 6), 2,
    )  # fmt: skip
    assert (STEP_KL.value(), STEP_MISMATCH.value(), STEP_MASKED.value()) == (kl, mismatch, masked)
    reset_memory_brokers()
    bus = await connect_bus(BusConfig(type="memory", url="memory://kl-report"), name="t")
    try:
        await bus.ensure_streams()
        await publish_step(bus, stats, progress, run_id="r", dropped={}, finished_at=0.0)
        reader = bus.subscribe(LEARNER_STEP, LearnerStep, deliver="all")
        try:
            msg = (await asyncio.wait_for(reader.__anext__(), 5.0)).msg
        finally:
            await reader.close()
    finally:
        await bus.close()
        reset_memory_brokers()
    assert (msg.kl, msg.mismatch_kl, msg.masked_share, msg.substeps) == (kl, mismatch, masked, 2)
    assert LearnerStep(step=0, policy_version=0).kl is None  # a step without a reference says so
