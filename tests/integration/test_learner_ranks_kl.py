"""KL to the frozen reference and substeps on 2 FSDP2 ranks (local Ray, gloo) against the single-process learner.

Its own file (its own Ray): test_learner_ranks.py's module-wide rank group holds the 2 CPUs its
local Ray offers while that module runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
import torch
from test_learner_ranks import SECTION, SOURCE, assert_same_weights, steps_data

from slipstream.engine.source import load_model
from slipstream.learner.ranks import RankGroup
from slipstream.learner.trainer import Trainer
from slipstream.rl import LossConfig

pytestmark = [
    pytest.mark.integration,
    # Ray's own start-up emits warnings this suite does not own.
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::ResourceWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
]


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# KL to the frozen reference and substeps. The reference pass is where the two kinds of reference
# differ across ranks: a full fine-tune's frozen copy is whole on every rank (no collective), while
# LoRA's is the sharded policy itself with its adapters off, a round of collectives every rank must
# join, empty micro-batches included (micro_batch 3 gives some rank an empty pass).
KL_SECTION = msgspec.structs.replace(SECTION, substeps=2, grad_clip=1.0)
KL_LOSS = LossConfig(kl_coef=0.2, kl_estimator="k3", off_policy_mask="token", mask_low=0.6, mask_high=1.6)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_two_ranks_with_kl_and_substeps_train_as_one_process(lora_rank: int) -> None:
    source = msgspec.structs.replace(SOURCE, lora_rank=lora_rank)
    data = steps_data(seed=5, steps=3)
    model, tok = load_model(source)
    single = Trainer(model, KL_SECTION, KL_LOSS, pad_id=tok.pad_id)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    assert single.reference is not None and single.reference.shares_policy == (lora_rank > 0)
    with RankGroup(source, KL_SECTION, KL_LOSS) as group:
        for version, groups in enumerate(data):
            one = single.step(groups, version)
            two = group.step(groups, version)
            assert one.substeps == two.substeps == 2, f"step {version}"
            assert two.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7), f"step {version}"
            assert two.figures["kl"] == pytest.approx(one.figures["kl"], rel=1e-4, abs=1e-9)
            assert two.figures["masked_share"] == pytest.approx(one.figures["masked_share"], rel=1e-6)
            assert two.figures["last_ratio_mean"] == pytest.approx(one.figures["last_ratio_mean"], rel=1e-5)
        assert one.figures["kl"] > 1e-6 and one.figures["masked_share"] > 0  # both terms were exercised
        # 6 AdamW updates at lr 3e-3 move weights ~1e-2; AdamW's per-element normalisation lifts the ranks'
        # float-order differences on near-zero gradients to ~6e-5 (2e-5 over test_learner_ranks's 5 updates).
        gathered = group.gathered_model().state_dict()
        assert_same_weights(gathered, single.model.state_dict(), atol=1e-4)
        moved = max(float((gathered[k] - initial[k]).abs().max()) for k in initial)
        assert moved > 5e-3  # the comparison is not between two untouched models
