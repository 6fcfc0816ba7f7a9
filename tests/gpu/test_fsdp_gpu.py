"""FSDP2 on one device: the learner's own `RankWorker` as a world of one in this process (its process
group: NCCL on CUDA, gloo on the CPU dry run; its `fully_shard` policy), one step equal to the
unsharded step within tolerance."""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from gpu_tier import Figures, Sizes, mfu, mfu_text, scored_groups, sequence_tokens

from slipstream.engine import build_tiny
from slipstream.engine.source import ModelSource
from slipstream.learner.config import LearnerSection
from slipstream.learner.ranks import RankWorker
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
_RENDEZVOUS_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _section() -> LearnerSection:
    return LearnerSection(lr=LR, micro_batch=16, autocast="bfloat16", rank_timeout_s=120.0)


@pytest.fixture
def rank(tier_device: str, sizes: Sizes) -> Iterator[RankWorker]:
    """Rank 0 of 1, set up as a Ray actor would set it up, in this process (no Ray involved)."""
    if tier_device == "cuda":
        torch.cuda.set_device(0)
    saved = {k: os.environ.get(k) for k in _RENDEZVOUS_ENV}
    source = ModelSource(preset=sizes.preset, seed=0, device=tier_device, threads=0)
    worker = RankWorker(0, 1, source, _section(), LossConfig())
    try:
        worker.setup("127.0.0.1", _free_port())
        yield worker
    finally:
        worker.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _plain_trainer(device: str, sizes: Sizes) -> Trainer:
    model, tok = build_tiny(sizes.preset, seed=0, device=device)
    return Trainer(model, _section(), LossConfig(), pad_id=tok.pad_id)


def _full(trainer: Trainer) -> dict[str, torch.Tensor]:
    out = {}
    for name, value in trainer.model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        out[name] = full.detach().clone()
    return out


def test_fsdp2_one_rank_step_equals_the_unsharded_step(
    tier_device: str, sizes: Sizes, figures: Figures, rank: RankWorker
) -> None:
    backend = dist.get_backend()
    assert backend == ("nccl" if tier_device == "cuda" else "gloo"), backend
    groups = scored_groups(sizes)
    plain = _plain_trainer(tier_device, sizes)
    assert rank.trainer is not None
    sharded = rank.trainer
    for t in (plain, sharded):
        t.autocast = "bfloat16"  # also where effective_autocast would drop it (an AVX2-only CPU)
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
        backend=backend,
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
