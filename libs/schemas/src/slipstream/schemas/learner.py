"""Metrics the learner publishes after each optimizer step."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

Doc = msgspec.Meta


class LearnerStep(msgspec.Struct, kw_only=True):
    """`learner.step`: one committed optimizer step."""

    SCHEMA: ClassVar[str] = "LearnerStep"
    VERSION: ClassVar[int] = 1

    step: int
    policy_version: Annotated[int, Doc(description="Version produced by this step.")]
    run_id: str = ""
    loss: float = 0.0
    reward_mean: float = 0.0
    accuracy: float = 0.0
    n_trajectories: int = 0
    n_groups: int = 0
    n_tokens: int = 0
    grad_norm: float = 0.0
    step_time_s: float = 0.0
    staleness: Annotated[dict[str, int], Doc(description="Histogram: versions behind -> trajectories.")] = {}
    dropped: Annotated[dict[str, int], Doc(description="Cumulative drops by reason.")] = {}
    finished_at: float = 0.0
