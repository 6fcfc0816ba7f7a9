"""The learner's metrics, named `learner/<subsystem>/<metric>` and rendered on `/metrics`."""

from __future__ import annotations

from slipstream.telemetry.metrics import counter, gauge, histogram

RECEIVED = counter("learner/intake/received", "Scored trajectories delivered to the intake.")
DROPPED_METRIC = counter("learner/intake/dropped", "Trajectories not trained on (label reason).")
REDELIVERED = counter("learner/intake/redelivered", "Redeliveries of a trajectory still held (settled with it).")
READY_GROUPS = gauge("learner/intake/ready_groups", "Complete, valid groups waiting for the trainer.")
PENDING_GROUPS = gauge("learner/intake/pending_groups", "Groups still waiting for members.")
STEP_TIME = gauge("learner/step/time_s", "Seconds of the last optimizer step (forward, backward, update).")
STEP_LOSS = gauge("learner/step/loss", "Loss of the last step.")
STEP_REWARD = gauge("learner/step/reward_mean", "Mean reward of the last step's trajectories.")
STEP_VERSION = gauge("learner/step/policy_version", "Version produced by the last step.")
STEP_KL = gauge("learner/step/kl", "Mean per-token KL to the frozen reference of the last step (kl_coef > 0 only).")
STEP_MISMATCH = gauge(
    "learner/step/mismatch_kl", "Train-inference mismatch of the last step: k3 KL(behaviour || learner) per token."
)
STEP_MASKED = gauge("learner/step/masked_share", "Share of the last step's trained tokens the off-policy mask removed.")
STALENESS = histogram(
    "learner/step/staleness", "Versions behind of each trained trajectory.", buckets=(0, 1, 2, 3, 4, 8, 16, 32)
)
MISSING_COMPONENTS = counter(
    "learner/reward/missing_component",
    "Trained episodes whose score lacks a scheduled reward component, counted as 0 (label component).",
)
HELD = gauge("learner/ack/held", "Trained trajectories waiting for their checkpoint before the ack.")
CHECKPOINT_S = gauge("learner/checkpoint/seconds", "Seconds the last checkpoint took to write.")
CHECKPOINTS = counter("learner/checkpoint/committed", "Checkpoints committed.")
SETTLE_ERRORS = counter("learner/ack/errors", "Acks, releases or heartbeats that did not reach the server (label op).")
PUBLISH_ERRORS = counter("learner/step/publish_errors", "learner.step messages that could not be published.")
