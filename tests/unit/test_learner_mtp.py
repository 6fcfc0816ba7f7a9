"""`[learner] mtp_distill_weight`: the MTP draft modules learn by self-distillation alongside RL, and
the policy's own update is exactly what it would have been without them."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo  # torch.optim's first use imports it (~2 s): pay that at collection
from test_learner_kl_substeps import on_policy_groups

from slipstream.engine import build_tiny
from slipstream.engine.mtp_distill import attach_mtp
from slipstream.learner.config import LearnerSection
from slipstream.learner.trainer import Trainer
from slipstream.rl import LossConfig

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def _trainer(weight: float) -> Trainer:
    model, tok = build_tiny("micro", seed=0)
    attach_mtp(model, 2, seed=1)
    # No gradient clipping: a clip over the joint norm would couple the two losses' updates.
    section = LearnerSection(lr=3e-3, grad_clip=0.0, mtp_distill_weight=weight)
    return Trainer(model, section, LossConfig(), pad_id=tok.pad_id)


def test_mtp_modules_distil_alongside_rl_and_leave_the_policy_update_alone() -> None:
    plain, distilled = _trainer(0.0), _trainer(1.0)
    groups = on_policy_groups(plain.model)
    mtp_before = {k: v.clone() for k, v in distilled.model.state_dict().items() if k.startswith("mtp.")}
    kls = []
    for step in range(4):
        plain.step(groups, version=step, step=step)
        stats = distilled.step(groups, version=step, step=step)
        kls.append(stats.figures["mtp_kl"])
    assert kls[-1] < kls[0], kls
    after = distilled.model.state_dict()
    assert all(not torch.equal(after[k], v) for k, v in mtp_before.items())
    for name, value in plain.model.state_dict().items():
        if not name.startswith("mtp."):
            assert torch.equal(after[name], value), name
        else:
            assert torch.equal(value, mtp_before[name]), name  # weight 0: the modules never move


def test_mtp_distill_weight_needs_mtp_modules() -> None:
    model, tok = build_tiny("micro", seed=0)
    with pytest.raises(ValueError, match=r"mtp_distill_weight 0\.5 needs a one-rank model with MTP modules"):
        Trainer(model, LearnerSection(mtp_distill_weight=0.5), LossConfig(), pad_id=tok.pad_id)
    with pytest.raises(ValueError, match=r"mtp_distill_weight must be >= 0, got -1\.0"):
        LearnerSection(mtp_distill_weight=-1.0)
