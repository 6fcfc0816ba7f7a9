"""Tasks, trajectories and their scores: what flows from the task source to the learner.

Per-token data (ids, behaviour log-probabilities, loss mask) is packed bytes; the policy version
that produced each token is stored as run-length segments, so a rollout that spanned a weight
update carries two (or more) versions.
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from slipstream.schemas.packing import unpack_floats, unpack_ids, unpack_mask

Doc = msgspec.Meta


class Task(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """One prompt to be sampled `group_size` times by a rollout worker."""

    SCHEMA: ClassVar[str] = "Task"
    VERSION: ClassVar[int] = 1

    task_id: Annotated[str, Doc(description="Stable id; the group key for advantages.")]
    env: Annotated[str, Doc(description="Environment name in the environment registry.")]
    prompt: Annotated[str, Doc(description="Prompt text shown to the policy.")]
    run_id: Annotated[str, Doc(description="Training run this task belongs to.")] = ""
    seed: Annotated[int, Doc(description="Seed the task was generated from.")] = 0
    split: Annotated[str, Doc(description="'train' or 'heldout'.")] = "train"
    group_size: Annotated[int, Doc(description="Completions to sample for this task.")] = 1
    reference: Annotated[str, Doc(description="Reference answer, for verifiers (never shown to the policy).")] = ""
    created_at: Annotated[float, Doc(description="Unix time the task was issued.")] = 0.0
    metadata: Annotated[dict[str, str], Doc(description="Free-form string tags.")] = {}
    min_policy_version: Annotated[
        int,
        Doc(
            description="Do not sample before the worker holds at least this version (bounds staleness at the source)."
        ),
    ] = 0


class PolicySegment(msgspec.Struct, array_like=True):
    """`n_tokens` consecutive completion tokens sampled under `policy_version`."""

    policy_version: int
    n_tokens: int


class Turn(msgspec.Struct, kw_only=True):
    """One turn of a multi-turn rollout: a span of the token sequence and what it was."""

    role: Annotated[str, Doc(description="'policy', 'tool', 'observation', 'subagent' or 'summary'.")]
    start: Annotated[int, Doc(description="First token index (into the full sequence).")]
    end: Annotated[int, Doc(description="One past the last token index.")]
    text: str = ""
    tool_name: str = ""
    tool_call: str = ""
    observation: str = ""


class Timings(msgspec.Struct, kw_only=True):
    """Wall-clock timestamps (unix seconds) and durations of one rollout."""

    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    generate_s: float = 0.0


class Trajectory(msgspec.Struct, kw_only=True):
    """One sampled completion of a task, with everything the learner needs to train on it."""

    SCHEMA: ClassVar[str] = "Trajectory"
    VERSION: ClassVar[int] = 1

    trajectory_id: Annotated[str, Doc(description="Globally unique; the idempotency key.")]
    task_id: str
    env: str
    run_id: str = ""
    group_index: Annotated[int, Doc(description="Index of this completion within its task's group.")] = 0
    group_size: int = 1
    prompt_len: Annotated[int, Doc(description="Number of prompt tokens at the start of token_ids.")] = 0
    token_ids: Annotated[bytes, Doc(description="Prompt + completion token ids, int32 little-endian.")] = b""
    logprobs: Annotated[bytes, Doc(description="Behaviour log-prob per completion token, float32 LE.")] = b""
    loss_mask: Annotated[bytes, Doc(description="1 per completion token trained on, 0 for observations; uint8.")] = b""
    segments: Annotated[list[PolicySegment], Doc(description="Run-length policy versions over completion tokens.")] = []
    turns: list[Turn] = []
    completion_text: str = ""
    finish_reason: Annotated[str, Doc(description="'stop', 'length', 'tool_budget', 'error', ...")] = ""
    worker_id: str = ""
    timings: Timings = msgspec.field(default_factory=Timings)
    metadata: dict[str, str] = {}
    group_id: Annotated[
        str, Doc(description="Id of this sampling of the task; a redelivered task forms a new group.")
    ] = ""
    split: Annotated[str, Doc(description="'train' or 'heldout' (copied from the task).")] = "train"
    reference: Annotated[
        str, Doc(description="The task's reference answer, for the verifier (never shown to the policy).")
    ] = ""

    # Convenience views; not part of the wire format.
    def ids(self) -> list[int]:
        return unpack_ids(self.token_ids)

    def behaviour_logprobs(self) -> list[float]:
        return unpack_floats(self.logprobs)

    def mask(self) -> list[int]:
        return unpack_mask(self.loss_mask)

    def completion_len(self) -> int:
        return len(self.token_ids) // 4 - self.prompt_len

    def versions(self) -> list[int]:
        """Distinct policy versions in sampling order."""
        out: list[int] = []
        for seg in self.segments:
            if not out or out[-1] != seg.policy_version:
                out.append(seg.policy_version)
        return out

    def oldest_version(self) -> int:
        return min((s.policy_version for s in self.segments), default=-1)


class ScoredTrajectory(msgspec.Struct, kw_only=True):
    """A trajectory with its reward: what the learner consumes."""

    SCHEMA: ClassVar[str] = "ScoredTrajectory"
    VERSION: ClassVar[int] = 1

    trajectory: Trajectory
    reward: Annotated[float, Doc(description="Total scalar reward.")]
    components: Annotated[dict[str, float], Doc(description="Named reward components summing to reward.")] = {}
    correct: Annotated[bool, Doc(description="Whether the verifier judged the answer correct.")] = False
    scorer_version: Annotated[str, Doc(description="Scorer name and version that produced the reward.")] = ""
    scored_at: float = 0.0
