"""The eval-gate's metrics, named `gate/<subsystem>/<metric>`, updated where things happen."""

from __future__ import annotations

from slipstream.telemetry.metrics import REGISTRY

_SECONDS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)

SCORE = REGISTRY.gauge("gate/eval/score", "Mean suite score of the last evaluated version (label suite).")
SCORED_VERSION = REGISTRY.gauge("gate/eval/version", "Policy version of the last evaluation (label suite).")
EVAL_SECONDS = REGISTRY.histogram(
    "gate/eval/seconds", "Seconds to evaluate one version on the suite (fetch + rollouts).", _SECONDS
)
PROMOTED = REGISTRY.counter("gate/decision/promoted", "Versions promoted by the gate.")
REJECTED = REGISTRY.counter(
    "gate/decision/rejected",
    "Versions rejected, by reason: too_few_samples, below_floor, worse_than_promoted, older_than_promoted, "
    "unloadable (weights could not be fetched or applied).",
)
PROMOTED_VERSION = REGISTRY.gauge("gate/promoted/version", "The promoted policy version as this gate last set it.")
SKIPPED = REGISTRY.counter(
    "gate/announce/skipped",
    "Announcements acked without evaluation, by reason: other_run, fenced, not_due, superseded, older_than_promoted.",
)
RETRIED = REGISTRY.counter(
    "gate/announce/retried", "Announcements handed back for later, by reason: control (Redis down), error."
)
