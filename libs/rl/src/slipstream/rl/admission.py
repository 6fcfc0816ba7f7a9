"""Admission rules: which trajectories the learner trains on, and why the others are dropped.

Rollouts are asynchronous, so a trajectory may have been sampled by a policy several versions
older than the learner's. The learner bounds that off-policyness: a trajectory whose *oldest*
token is more than `max_staleness` versions behind is dropped; the rest are trained on, with the
loss correcting for the gap through the behaviour log-probabilities recorded at sampling time
(see losses.py). `max_staleness = 0` admits only tokens from the current version, which is the
synchronous baseline the async speed-up is measured against.

Every drop is counted under a `DropReason`, whose string values are the keys of
`LearnerStep.dropped`.
"""

from __future__ import annotations

from enum import StrEnum


class DropReason(StrEnum):
    """Why a trajectory (or a whole group) was not trained on."""

    STALE = "stale"
    """Its oldest token is more than `max_staleness` policy versions behind the learner."""
    UNIFORM_GROUP = "uniform_group"
    """Every sample of its group got the same reward: all advantages are zero, no signal."""
    MALFORMED = "malformed"
    """Fails validation: undecodable, inconsistent lengths, no policy segments, a version ahead of the learner."""
    DUPLICATE = "duplicate"
    """Its trajectory_id was already trained on (redelivery after a crash or a retry)."""
    NO_TRAINED_TOKENS = "no_trained_tokens"
    """Its loss mask is all zeros: nothing the policy generated is trainable."""
    INFRA_ERROR = "infra_error"
    """An infrastructure failure (tool backend down, timeout) spoiled the episode: never the model's fault."""
    UNSCORABLE = "unscorable"
    """Part of its reward could not be computed (a judge gave no usable verdict): never a silent 0, and
    left out of its group's baseline."""
    INCOMPLETE_GROUP = "incomplete_group"
    """Its group never filled up within the learner's wait budget, so no baseline can be formed."""
    UNTRUSTED = "untrusted"
    """Its score carries no valid signature by a trusted reward-model key (missing, foreign or not matching):
    never trained and never counted in its group, whoever published it."""


def _check_version(name: str, value: int) -> None:
    if value < 0:
        raise ValueError(f"{name} must be a policy version >= 0, got {value}")


def staleness(oldest_version: int, current_version: int) -> int:
    """Versions the oldest token lags the learner: current_version − oldest_version (>= 0).

    A trajectory sampled entirely by the current policy has staleness 0. A negative version
    (e.g. `Trajectory.oldest_version()` = −1 for a trajectory without segments) or a version
    ahead of the learner is an error: neither can come from a healthy pipeline, and the caller
    should drop the trajectory as `DropReason.MALFORMED`.
    """
    _check_version("oldest_version", oldest_version)
    _check_version("current_version", current_version)
    if oldest_version > current_version:
        raise ValueError(f"oldest_version {oldest_version} is ahead of the learner's current_version {current_version}")
    return current_version - oldest_version


def is_stale(oldest_version: int, current_version: int, max_staleness: int) -> bool:
    """True when the trajectory must be dropped: staleness > max_staleness.

    The bound is inclusive: exactly `max_staleness` versions behind is still admitted, so
    max_staleness = 0 admits only current-version tokens and max_staleness = 2 admits versions
    current, current − 1 and current − 2.
    """
    if max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    return staleness(oldest_version, current_version) > max_staleness
