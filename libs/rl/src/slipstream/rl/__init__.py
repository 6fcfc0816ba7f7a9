"""Slipstream RL math: group advantages, episode credit, admission rules, policy losses and batching.

Pure, typed functions over tensors or plain values, each tested on tiny inputs against
hand-computed numbers (tests/unit/test_rl_*.py). Nothing here does I/O; only `credit` reads the
wire record (episodes), to turn it into training rows.

Names are imported lazily (PEP 562): `from slipstream.rl import LossConfig` in a service config
does not pull in torch; the tensor functions load it on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "DropReason": "admission",
    "is_stale": "admission",
    "staleness": "admission",
    "group_advantages": "advantages",
    "is_uniform_group": "advantages",
    "SampleWeighting": "credit",
    "agent_advantages": "credit",
    "group_rows": "credit",
    "sample_weights": "credit",
    "token_advantages": "credit",
    "turn_mismatch": "batch",
    "Batch": "batch",
    "TrainItem": "batch",
    "pack_batch": "batch",
    "token_logprobs": "batch",
    "KL_ESTIMATORS": "config",
    "KLEstimator": "config",
    "LossConfig": "config",
    "OFF_POLICY_MASKS": "config",
    "OffPolicyMask": "config",
    "kl_per_token": "kl",
    "LossOutput": "losses",
    "PolicyLoss": "losses",
    "PolicyTerms": "losses",
    "compute_loss": "losses",
    "get_loss": "losses",
    "loss_types": "losses",
    "off_policy_keep": "losses",
    "register_loss": "losses",
}

__all__ = [
    "KL_ESTIMATORS",
    "OFF_POLICY_MASKS",
    "Batch",
    "DropReason",
    "KLEstimator",
    "LossConfig",
    "LossOutput",
    "OffPolicyMask",
    "PolicyLoss",
    "PolicyTerms",
    "SampleWeighting",
    "TrainItem",
    "agent_advantages",
    "compute_loss",
    "get_loss",
    "group_advantages",
    "group_rows",
    "is_stale",
    "is_uniform_group",
    "kl_per_token",
    "loss_types",
    "off_policy_keep",
    "pack_batch",
    "register_loss",
    "sample_weights",
    "staleness",
    "token_advantages",
    "token_logprobs",
    "turn_mismatch",
]

if TYPE_CHECKING:
    from slipstream.rl.admission import DropReason, is_stale, staleness
    from slipstream.rl.advantages import group_advantages, is_uniform_group
    from slipstream.rl.batch import Batch, TrainItem, pack_batch, token_logprobs, turn_mismatch
    from slipstream.rl.config import KL_ESTIMATORS, OFF_POLICY_MASKS, KLEstimator, LossConfig, OffPolicyMask
    from slipstream.rl.credit import SampleWeighting, agent_advantages, group_rows, sample_weights, token_advantages
    from slipstream.rl.kl import kl_per_token
    from slipstream.rl.losses import (
        LossOutput,
        PolicyLoss,
        PolicyTerms,
        compute_loss,
        get_loss,
        loss_types,
        off_policy_keep,
        register_loss,
    )


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"slipstream.rl.{module}"), name)
    globals()[name] = value
    return value
