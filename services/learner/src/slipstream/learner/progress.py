"""Where the learner stands: its last step, the version that step staged, and the last committed step.

One mutable record, shared by the service (which advances the step and the version), the
committer (which advances the committed step) and the lead (which checks, before it takes a
lapsed lease back, that the run's durable state is still what these numbers say).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Progress:
    """The learner's step counters; all 0 until the resume point is known."""

    step: int = 0
    """The last optimizer step applied (counted across restarts, from the checkpoint)."""
    version: int = 0
    """The `policy_version` the last step staged (or the one the learner resumed at)."""
    committed_step: int = 0
    """The step of the last committed checkpoint; trajectories trained after it are still held."""
