"""Slipstream RL math: group advantages, admission rules, policy losses and batch packing.

Pure, typed functions over tensors or plain values, each tested on tiny inputs against
hand-computed numbers (tests/unit/test_rl_*.py). Nothing here does I/O or knows the wire schema.
"""

from slipstream.rl.admission import DropReason, is_stale, staleness
from slipstream.rl.advantages import group_advantages, is_uniform_group
from slipstream.rl.batch import Batch, TrainItem, pack_batch, token_logprobs
from slipstream.rl.kl import KL_ESTIMATORS, KLEstimator, kl_per_token
from slipstream.rl.losses import (
    LossConfig,
    LossOutput,
    PolicyLoss,
    PolicyTerms,
    compute_loss,
    get_loss,
    loss_types,
    register_loss,
)

__all__ = [
    "KL_ESTIMATORS",
    "Batch",
    "DropReason",
    "KLEstimator",
    "LossConfig",
    "LossOutput",
    "PolicyLoss",
    "PolicyTerms",
    "TrainItem",
    "compute_loss",
    "get_loss",
    "group_advantages",
    "is_stale",
    "is_uniform_group",
    "kl_per_token",
    "loss_types",
    "pack_batch",
    "register_loss",
    "staleness",
    "token_logprobs",
]
