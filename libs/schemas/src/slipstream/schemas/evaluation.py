"""Eval-gate results."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

Doc = msgspec.Meta


class EvalResult(msgspec.Struct, kw_only=True):
    """`eval.result`: the summary of one candidate's evaluation; details live in the object store."""

    SCHEMA: ClassVar[str] = "EvalResult"
    VERSION: ClassVar[int] = 1

    policy_version: int
    suite: str
    score: Annotated[float, Doc(description="Mean score over the suite.")]
    ci_low: float = 0.0
    ci_high: float = 0.0
    n_samples: int = 0
    baseline_version: int | None = None
    baseline_score: float | None = None
    decision: Annotated[str, Doc(description="'promote' or 'reject'.")] = "reject"
    reason: str = ""
    details_key: Annotated[str, Doc(description="Object-store key of the per-task details.")] = ""
    run_id: str = ""
    evaluated_at: float = 0.0
