"""Metrics the learner publishes after each optimizer step."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

Doc = msgspec.Meta


class LearnerStep(msgspec.Struct, kw_only=True):
    """`learner.step`: one committed optimizer step."""

    SCHEMA: ClassVar[str] = "LearnerStep"
    VERSION: ClassVar[int] = 1

    step: int
    policy_version: Annotated[int, Doc(description="Version produced by this step.")]
    run_id: str = ""
    loss: float = 0.0
    reward_mean: float = 0.0
    accuracy: float = 0.0
    n_trajectories: int = 0
    n_groups: int = 0
    n_tokens: int = 0
    grad_norm: float = 0.0
    step_time_s: float = 0.0
    staleness: Annotated[dict[str, int], Doc(description="Histogram: versions behind -> trajectories.")] = {}
    dropped: Annotated[dict[str, int], Doc(description="Cumulative drops by reason.")] = {}
    finished_at: float = 0.0
    n_samples: Annotated[int, Doc(description="Training rows: trainable samples of the step's episodes.")] = 0
    turns_per_episode: Annotated[float, Doc(description="Mean policy turns per trained episode.")] = 0.0
    tool_calls_per_turn: Annotated[float, Doc(description="Tool calls / policy turns over the step's episodes.")] = 0.0
    invalid_call_rate: Annotated[
        float, Doc(description="Invalid tool calls / tool calls over the step's episodes (0 without calls).")
    ] = 0.0
    samples_per_episode: Annotated[float, Doc(description="Mean samples per trained episode (frozen included).")] = 0.0
    logprob_mismatch_by_turn: Annotated[
        dict[str, float],
        Doc(
            description="Policy-turn index -> mean (behaviour - current) log-prob over its trained tokens, "
            "before the update: drift at turn boundaries shows as growth with the index."
        ),
    ] = {}
    summaries_per_episode: Annotated[
        float, Doc(description="Mean self-summaries per trained episode (context restarts, `edit=summary`).")
    ] = 0.0
    tokens_per_episode: Annotated[
        float, Doc(description="Mean tokens per trained episode, every sample's prompt and completion counted.")
    ] = 0.0
    reward_weights: Annotated[
        dict[str, float],
        Doc(
            description="λ of each scheduled reward component at this step ([learner] reward_schedule; the schedule "
            "counts steps already taken, so message `step` = k carries λ(k - 1)); empty without a schedule."
        ),
    ] = {}
    episode_means: Annotated[
        dict[str, float],
        Doc(
            description="Means over the step's trained episodes: each count named in [learner] step_means that any "
            "episode has (critical_steps, total_steps, subagents, subagents_finished by default; 0 where absent), "
            "and every score component as 'component.<name>'."
        ),
    ] = {}
    kl: Annotated[
        float | None,
        Doc(
            description="Mean per-token KL of the policy to its frozen reference over the step's trained tokens, "
            "before the update, with [loss] kl_estimator; null when the step ran no reference (kl_coef = 0)."
        ),
    ] = None
    mismatch_kl: Annotated[
        float,
        Doc(
            description="Train-inference mismatch: k3 estimate of KL(behaviour ‖ learner) per trained token, the "
            "workers' recorded log-probs against the learner's recomputed ones before the update."
        ),
    ] = 0.0
    masked_share: Annotated[
        float,
        Doc(description="Share of the step's trained tokens [loss] off_policy_mask removed from the loss (0 off)."),
    ] = 0.0
    substeps: Annotated[
        int, Doc(description="Optimizer updates applied over the step's batch ([learner] substeps).")
    ] = 1
    moe_aux_loss: Annotated[
        float | None,
        Doc(
            description="MoE models: the load-balancing auxiliary loss per trained token before the update (1.0 at "
            "uniform routing), added at [learner] moe_aux_coef; null for a dense model."
        ),
    ] = None
