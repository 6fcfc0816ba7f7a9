"""The rollout worker's metrics, named `worker/<subsystem>/<metric>`, and the loop that samples gauges.

Counters and histograms are updated where things happen; the gauges that describe the engine
(throughput, in-flight tasks) are sampled once a second by `sample_gauges`, so /metrics stays
current even while nothing finishes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from slipstream.engine.interface import Engine
from slipstream.telemetry.metrics import REGISTRY

_MS_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 500.0, 1000.0, 5000.0)

TOKENS_PER_S = REGISTRY.gauge("worker/engine/tokens_per_s", "Tokens generated per second of engine step time.")
INFLIGHT = REGISTRY.gauge("worker/tasks/inflight", "Tasks taken and not yet settled.")
TASKS = REGISTRY.counter(
    "worker/tasks/settled",
    "Tasks settled, by outcome: acked, nak_version_wait, nak_publish, nak_error, released, rejected.",
)
VERSION_WAIT_TIMEOUTS = REGISTRY.counter(
    "worker/tasks/version_wait_timeouts", "Tasks handed back because min_policy_version was not reached in time."
)
ROLLOUT_S = REGISTRY.histogram("worker/tasks/rollout_s", "Seconds to sample one task's group.")
HEARTBEAT_ERRORS = REGISTRY.counter("worker/tasks/heartbeat_errors", "In-progress signals that could not be sent.")
FETCH_ERRORS = REGISTRY.counter("worker/tasks/fetch_errors", "Failed fetches from the task consumer (retried).")
PUBLISHED = REGISTRY.counter("worker/trajectories/published", "Episodes acknowledged by JetStream, by env.")
OFFLOADED = REGISTRY.counter(
    "worker/trajectories/offloaded", "Episodes over the bus limit published by reference (body in the store), by env."
)
APPLIED_VERSION = REGISTRY.gauge("worker/weights/applied_version", "Policy version the engine samples with.")
PAUSE_MS = REGISTRY.histogram(
    "worker/weights/pause_ms", "Milliseconds decoding paused to copy a new version in.", buckets=_MS_BUCKETS
)
TIME_TO_POLICY_S = REGISTRY.histogram(
    "worker/weights/time_to_policy_s", "Seconds from the optimizer step's end to the first token sampled under it."
)
FETCH_S = REGISTRY.histogram("worker/weights/fetch_s", "Seconds to fetch and verify one weight version.")
FETCH_FAILURES = REGISTRY.counter(
    "worker/weights/fetch_failures", "Weight versions not applied, by reason: fetch, mismatch, apply, timeout."
)
ANNOUNCES_SKIPPED = REGISTRY.counter(
    "worker/weights/announces_skipped",
    "Announcements ignored, by reason: other_run, fenced (its learner no longer leads), not_newer, superseded, "
    "current (serving worker already on it), pinned (a pool worker keeps its pinned version).",
)
PINNED_IGNORED = REGISTRY.counter(
    "worker/weights/pinned_ignored", "Announcements seen by a pinned (sub-agent pool) worker and not applied."
)
SUBAGENTS = REGISTRY.counter(
    "worker/subagents/served",
    "Sub-agent requests settled by a pool worker, by outcome: ok, replayed, error, expired, no_reply_to, released.",
)
SUBAGENT_S = REGISTRY.histogram("worker/subagents/play_s", "Seconds a pool worker spent playing one sub-agent.")
SUBAGENT_REQUESTS = REGISTRY.counter(
    "worker/subagents/requests",
    "Sub-agent requests an orchestrator's worker sent to the pool, by outcome: ok, retried, unavailable, "
    "wrong_version (a reply from a pool pinned to another version, rejected).",
)


async def sample_gauges(engine: Engine, inflight: Callable[[], int], stop: asyncio.Event, every_s: float = 1.0) -> None:
    """Refresh the engine gauges every `every_s` until `stop` is set."""
    while not stop.is_set():
        stats = engine.stats()
        TOKENS_PER_S.set(stats.get("tokens_per_s", 0.0))
        APPLIED_VERSION.set(float(engine.policy_version))
        INFLIGHT.set(float(inflight()))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
