"""Slipstream's rollout harness: one rollout loop for training, eval-gate and serving.

- `rollout_group`: a task sampled `group_size` times against its environment -> Trajectories.
- `evaluate`: held-out accuracy and reward of an engine's current weights, via the same loop.
- `sft_warmstart`: a short supervised phase so RL starts from a policy that sometimes succeeds.
"""

from slipstream.harness.evaluate import EvalReport, TaskEval, evaluate, greedy_params
from slipstream.harness.rollout import (
    RolloutAborted,
    RolloutError,
    TaskRejected,
    as_spec,
    completion_seed,
    new_group_id,
    prompt_ids,
    rollout_group,
)
from slipstream.harness.warmstart import sft_sequence, sft_warmstart

__all__ = [
    "EvalReport",
    "RolloutAborted",
    "RolloutError",
    "TaskEval",
    "TaskRejected",
    "as_spec",
    "completion_seed",
    "evaluate",
    "greedy_params",
    "new_group_id",
    "prompt_ids",
    "rollout_group",
    "sft_sequence",
    "sft_warmstart",
]
