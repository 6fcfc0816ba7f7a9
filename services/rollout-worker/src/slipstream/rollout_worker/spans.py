"""The rollout-worker's own span: `rollout.generate`, one per episode.

A task's trace reaches the worker through the task's headers (the intake's consumer span); under
it each episode gets a `rollout.generate` span, timed by the engine's own clock (first decode
step to last token) and tagged with the policy versions that sampled it, and the episode is
published inside that span, so the reward model's work continues from it. (A weight version's
trace, learner step -> weights.publish -> announce, ends in the follower's `weights.apply` span.)
Nothing here runs while tracing is off: the outbox checks `tracing_active()` first.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace

from slipstream.bus.tracing import AttributeValue, message_ids
from slipstream.schemas import Episode

_TRACER = "slipstream.rollout_worker"


def _ns(unix_s: float) -> int | None:
    return int(unix_s * 1e9) if unix_s > 0 else None


def policy_versions(e: Episode) -> list[int]:
    """The versions that sampled `e`'s trainable samples, oldest first, each once."""
    return sorted({seg.policy_version for s in e.samples if s.trainable for seg in s.segments})


def generation_attributes(e: Episode) -> dict[str, AttributeValue | list[int]]:
    """The ids of one episode and what produced it."""
    versions = policy_versions(e)
    attrs: dict[str, AttributeValue | list[int]] = {
        **message_ids(e),
        "slipstream.group_index": e.group_index,
        "slipstream.policy_versions": versions,
        "slipstream.turns": e.counts.get("turns", 0),
        "slipstream.samples": len(e.samples),
        "slipstream.finish_reason": e.finish_reason,
    }
    if versions:
        # The oldest version is the one staleness is measured by.
        attrs["slipstream.policy_version"] = versions[0]
    return attrs


@contextmanager
def generation_span(t: Episode) -> Iterator[Any]:
    """A `rollout.generate` span over `t`'s generation, current while the caller publishes `t`.

    The span runs from the engine's start to its last token (the episode's timings), so its
    length is generation time; the publish inside it is its child and may end after it.
    """
    start, end = _ns(t.timings.started_at), _ns(t.timings.finished_at)
    span = trace.get_tracer(_TRACER).start_span(
        "rollout.generate", start_time=start, attributes=generation_attributes(t)
    )
    try:
        with trace.use_span(span, end_on_exit=False):
            yield span
    finally:
        span.end(end_time=end if end is not None and start is not None and end >= start else None)
