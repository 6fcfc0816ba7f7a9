"""slipstream.judge: generative reward models (rubric judges) over any OpenAI-compatible endpoint.

Names are imported lazily (PEP 562): a service config that names `JudgeConfig` does not pull in
the `openai` client, so `--help` stays instant.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    "aggregate": "aggregation",
    "AGGREGATE": "drift",
    "RubricAgreement": "drift",
    "agreement": "drift",
    "format_agreement": "drift",
    "with_aggregate": "drift",
    "VerdictCache": "cache",
    "cache_key": "cache",
    "AGGREGATIONS": "config",
    "JudgeConfig": "config",
    "CallFailed": "judge",
    "Judge": "judge",
    "JudgeStats": "judge",
    "RubricResult": "judge",
    "TokenBucket": "limits",
    "retry_after_s": "limits",
    "Rubric": "rubrics",
    "RubricError": "rubrics",
    "RubricSet": "rubrics",
    "load_rubric_sets": "rubrics",
    "parse_rubric_sets": "rubrics",
    "sample_rubrics": "rubrics",
    "select_set": "rubrics",
    "PROMPT_KEY": "verdict",
    "JudgeInput": "verdict",
    "MalformedVerdict": "verdict",
    "judge_messages": "verdict",
    "parse_verdict": "verdict",
}

__all__ = [
    "AGGREGATE",
    "AGGREGATIONS",
    "PROMPT_KEY",
    "CallFailed",
    "Judge",
    "JudgeConfig",
    "JudgeInput",
    "JudgeStats",
    "MalformedVerdict",
    "Rubric",
    "RubricAgreement",
    "RubricError",
    "RubricResult",
    "RubricSet",
    "TokenBucket",
    "VerdictCache",
    "aggregate",
    "agreement",
    "cache_key",
    "format_agreement",
    "judge_messages",
    "load_rubric_sets",
    "parse_rubric_sets",
    "parse_verdict",
    "retry_after_s",
    "sample_rubrics",
    "select_set",
    "with_aggregate",
]

if TYPE_CHECKING:
    from slipstream.judge.aggregation import aggregate
    from slipstream.judge.cache import VerdictCache, cache_key
    from slipstream.judge.config import AGGREGATIONS, JudgeConfig
    from slipstream.judge.drift import AGGREGATE, RubricAgreement, agreement, format_agreement, with_aggregate
    from slipstream.judge.judge import CallFailed, Judge, JudgeStats, RubricResult
    from slipstream.judge.limits import TokenBucket, retry_after_s
    from slipstream.judge.rubrics import (
        Rubric,
        RubricError,
        RubricSet,
        load_rubric_sets,
        parse_rubric_sets,
        sample_rubrics,
        select_set,
    )
    from slipstream.judge.verdict import PROMPT_KEY, JudgeInput, MalformedVerdict, judge_messages, parse_verdict


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.judge' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"slipstream.judge.{module}"), name)
    globals()[name] = value
    return value
