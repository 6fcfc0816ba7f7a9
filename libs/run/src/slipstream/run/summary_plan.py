"""A training plan's self-summarising chains as the harness's `SummaryConfig` (None when off).

Its own module because the warm-start (training.py), the held-out evaluation (heldout.py) and
`slipstream bench summary` all read it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from slipstream.run.plan import TrainingPlan


def summary_config(plan: TrainingPlan) -> Any:
    """The plan's `SummaryConfig` (None when off); a bad one is a ValueError naming the field."""
    from slipstream.harness.summary import SummaryConfig

    if not plan.summary:
        return None
    try:
        config = msgspec.convert(plan.summary, SummaryConfig)
    except msgspec.ValidationError as exc:
        raise ValueError(f"plan.summary: {exc}") from exc
    return config if config.enabled else None
