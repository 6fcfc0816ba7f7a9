"""FSDP2 on one device: a 1-rank process group (NCCL on CUDA, gloo on the CPU dry run), the learner's
own `shard_model` over the policy, and one step equal to the unsharded step within tolerance."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from gpu_tier import Figures, Sizes, mfu, mfu_text, scored_groups, sequence_tokens

from slipstream.engine import build_tiny
from slipstream.learner.config import LearnerSection
from slipstream.learner.ranks import shard_model
from slipstream.learner.trainer import Trainer
from slipstream.rl import LossConfig

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

LR = 1e-4
# One rank holds every shard, so the sharded step runs the same math as the unsharded one; what
# differs is the forward's route (FSDP's full-logits path against the trainer's trimmed lm_head)
# and bf16 rounding under autocast. Loss to this relative tolerance; weights to 2 x lr where a
# near-zero gradient's sign flips, on few elements.
LOSS_RTOL = 1e-3
SIGN_AGREEMENT = 0.95


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def one_rank_group(tier_device: str) -> Iterator[str]:
    """A world of one in this process; yields its backend."""
    backend = "nccl" if tier_device == "cuda" else "gloo"
    if tier_device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{_free_port()}",
        rank=0,
        world_size=1,
        timeout=timedelta(seconds=120),
    )
    try:
        yield backend
    finally:
        dist.destroy_process_group()


def _trainer(device: str, sizes: Sizes, *, sharded: bool) -> Trainer:
    model, tok = build_tiny(sizes.preset, seed=0, device=device)
    if sharded:
        shard_model(model)
    section = LearnerSection(lr=LR, micro_batch=16, autocast="bfloat16")
    out = Trainer(model, section, LossConfig(), pad_id=tok.pad_id)
    out.autocast = "bfloat16"  # also where effective_autocast would drop it (an AVX2-only CPU)
    return out


def _full(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in trainer.model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def test_fsdp2_one_rank_step_equals_the_unsharded_step(
    tier_device: str, sizes: Sizes, figures: Figures, one_rank_group: str
) -> None:
    groups = scored_groups(sizes)
    plain = _trainer(tier_device, sizes, sharded=False)
    sharded = _trainer(tier_device, sizes, sharded=True)
    assert any(hasattr(p, "full_tensor") for p in sharded.model.parameters()), "fully_shard made no DTensors"
    before = _full(sharded)
    assert before.keys() == _full(plain).keys()

    want = plain.step(groups, version=0)
    got = sharded.step(groups, version=0)
    assert got.applied and want.applied
    assert math.isfinite(got.loss), got.loss
    assert got.loss == pytest.approx(want.loss, rel=LOSS_RTOL), (got.loss, want.loss)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-2), (got.grad_norm, want.grad_norm)

    after_sharded, after_plain = _full(sharded), _full(plain)
    agree = total = 0
    for name, start in before.items():
        moved_sharded = after_sharded[name] - start
        moved_plain = after_plain[name] - start
        assert float((moved_sharded - moved_plain).abs().max()) <= 2 * LR * 1.01, name
        agree += int((torch.sign(moved_sharded) == torch.sign(moved_plain)).sum())
        total += start.numel()
    assert agree / total >= SIGN_AGREEMENT, f"sharded and unsharded steps agree on {agree / total:.3f} of weights"
    assert sum(int((after_sharded[k] != v).sum()) for k, v in before.items()) > total // 2, "the weights did not move"

    if tier_device == "cuda":
        torch.cuda.synchronize()
    start_t = time.perf_counter()
    for version in range(1, sizes.timed_steps + 1):
        assert sharded.step(groups, version=version).applied
    if tier_device == "cuda":
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - start_t) / sizes.timed_steps
    n_params = sum(v.numel() for v in before.values() if v.is_floating_point())
    tokens = sequence_tokens(sizes)
    share = mfu(6.0 * n_params * tokens, step_s, figures.peak)
    figures.record(
        "fsdp2_one_rank_step",
        backend=one_rank_group,
        preset=sizes.preset,
        params=n_params,
        tokens_per_step=tokens,
        step_s=step_s,
        tokens_per_s=tokens / step_s,
        mfu=share,
        mfu_text=mfu_text(share),
        loss_sharded=got.loss,
        loss_unsharded=want.loss,
        weight_sign_agreement=agree / total,
    )
