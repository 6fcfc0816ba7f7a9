"""A learner step on the tier's device under bf16 autocast: finite, close to the fp32 step, the
weights move; its tokens/s, step time and MFU."""

from __future__ import annotations

import math
import time

import pytest
import torch
from gpu_tier import Figures, Sizes, mfu, mfu_text, scored_groups, sequence_tokens

from slipstream.engine import build_tiny
from slipstream.learner.config import LearnerSection
from slipstream.learner.trainer import Trainer
from slipstream.rl import LossConfig

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

LR = 1e-4
# bf16 matmuls (8-bit mantissa) against fp32: the step's loss agrees to this relative tolerance, or
# this absolute one (the policy loss sums advantage-weighted ratios whose advantages cancel within
# each group, so it is small, ~1e-3 here, and its rounding error need not shrink with it)...
LOSS_RTOL = 1e-2
LOSS_ATOL = 1e-4
# ...and AdamW's first step moves each weight by ~lr * sign(grad), so the two steps' weights differ
# by at most 2 * lr per element (where a tiny gradient's sign flips), on few elements.
SIGN_AGREEMENT = 0.9


def trainer(device: str, sizes: Sizes, autocast: str) -> Trainer:
    model, tok = build_tiny(sizes.preset, seed=0, device=device)
    section = LearnerSection(lr=LR, micro_batch=16, autocast=autocast)  # type: ignore[arg-type]
    out = Trainer(model, section, LossConfig(), pad_id=tok.pad_id)
    if autocast and out.autocast != autocast:
        # effective_autocast drops bf16 on an x86 CPU without AVX-512 (slow there); the dry run
        # still exercises the bf16 path, only slower.
        out.autocast = autocast  # type: ignore[assignment]
    return out


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def test_bf16_learner_step_matches_fp32_and_reports_throughput(
    tier_device: str, sizes: Sizes, figures: Figures
) -> None:
    groups = scored_groups(sizes)
    bf16 = trainer(tier_device, sizes, "bfloat16")
    fp32 = trainer(tier_device, sizes, "")
    before = {k: v.detach().clone() for k, v in bf16.model.state_dict().items()}

    got = bf16.step(groups, version=0)
    want = fp32.step(groups, version=0)
    assert got.applied and want.applied
    assert math.isfinite(got.loss) and math.isfinite(got.grad_norm), (got.loss, got.grad_norm)
    assert got.loss == pytest.approx(want.loss, rel=LOSS_RTOL, abs=LOSS_ATOL), (got.loss, want.loss)
    assert got.n_tokens == want.n_tokens == sizes.groups * sizes.group_size * sizes.completion_len

    after_bf16 = bf16.model.state_dict()
    after_fp32 = fp32.model.state_dict()
    agree = total = 0
    for name, start in before.items():
        moved_bf16 = after_bf16[name] - start
        moved_fp32 = after_fp32[name] - start
        assert float((moved_bf16 - moved_fp32).abs().max()) <= 2 * LR * 1.01, name
        agree += int((torch.sign(moved_bf16) == torch.sign(moved_fp32)).sum())
        total += start.numel()
    moved = sum(int((after_bf16[k] != v).sum()) for k, v in before.items())
    assert moved > total // 2, f"only {moved} of {total} weights moved"
    assert agree / total >= SIGN_AGREEMENT, f"bf16 and fp32 steps moved weights the same way on {agree / total:.3f}"

    # Timed steps after the first (which paid for kernel selection and the allocator).
    _sync(tier_device)
    start = time.perf_counter()
    for version in range(1, sizes.timed_steps + 1):
        stats = bf16.step(groups, version=version)
        assert stats.applied and math.isfinite(stats.loss)
    _sync(tier_device)
    step_s = (time.perf_counter() - start) / sizes.timed_steps

    n_params = sum(p.numel() for p in bf16.model.parameters())
    tokens = sequence_tokens(sizes)
    # Training FLOPs ~ 6 x parameters x tokens (forward 2, backward 4; attention left out).
    share = mfu(6.0 * n_params * tokens, step_s, figures.peak)
    figures.record(
        "learner_bf16_step",
        preset=sizes.preset,
        params=n_params,
        autocast=bf16.autocast,
        sequences=sizes.groups * sizes.group_size,
        seq_len=sizes.prompt_len + sizes.completion_len,
        tokens_per_step=tokens,
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=share,
        mfu_text=mfu_text(share),
        loss_bf16=got.loss,
        loss_fp32=want.loss,
        weight_sign_agreement=agree / total,
    )
