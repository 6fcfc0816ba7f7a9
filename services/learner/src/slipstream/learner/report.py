"""How a finished step is reported: its gauges and log line, and its `learner.step` message on the bus.

Kept apart from the step itself so `service.py` reads as the loop: train, stage, report, commit.
The message is best effort: a publish that fails is counted and logged, never retried, and never
holds up training.
"""

from __future__ import annotations

from slipstream.bus import Bus, PublishError
from slipstream.learner.instruments import (
    HELD,
    MISSING_COMPONENTS,
    PUBLISH_ERRORS,
    STALENESS,
    STEP_KL,
    STEP_LOSS,
    STEP_MASKED,
    STEP_MISMATCH,
    STEP_REWARD,
    STEP_TIME,
    STEP_VERSION,
)
from slipstream.learner.progress import Progress
from slipstream.learner.trainer import StepStats
from slipstream.schemas import LearnerStep
from slipstream.schemas.subjects import LEARNER_STEP
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)
_warned_missing: set[str] = set()
"""Scheduled components already warned about as missing from a score (one warning each per process)."""


def observe(stats: StepStats, progress: Progress, *, held: int) -> None:
    """Set the step gauges and the staleness histogram, and log the step."""
    STEP_TIME.set(stats.time_s)
    STEP_LOSS.set(stats.loss)
    STEP_REWARD.set(stats.reward_mean)
    STEP_VERSION.set(progress.version)
    STEP_MISMATCH.set(stats.figures.get("behaviour_kl", 0.0))
    STEP_MASKED.set(stats.figures.get("masked_share", 0.0))
    if "kl" in stats.figures:
        STEP_KL.set(stats.figures["kl"])
    HELD.set(held)
    for lag, n in stats.staleness.items():
        for _ in range(n):
            STALENESS.observe(float(lag))
    for name, n in stats.missing_components.items():
        MISSING_COMPONENTS.add(n, component=name)
        if name not in _warned_missing:
            _warned_missing.add(name)
            log.warning(
                "a scheduled reward component is missing from episodes' scores; it counts as 0 there "
                "(counted in learner/reward/missing_component)",
                component=name,
                episodes=n,
                step=progress.step,
            )
    log.info(
        "step",
        step=progress.step,
        policy_version=progress.version,
        loss=round(stats.loss, 6),
        reward_mean=round(stats.reward_mean, 4),
        accuracy=round(stats.accuracy, 4),
        n_trajectories=stats.n_trajectories,
        n_tokens=stats.n_tokens,
        grad_norm=round(stats.grad_norm, 4),
        time_s=round(stats.time_s, 3),
        staleness=stats.staleness,
        n_samples=stats.n_samples,
        **({"reward_weights": _rounded(stats.reward_weights, 6)} if stats.reward_weights else {}),
        **{k: round(v, 4) for k, v in stats.episodes.items()},
        **({"episode_means": _rounded(stats.episode_means, 4)} if stats.episode_means else {}),
        **{k: round(v, 4) for k, v in stats.figures.items() if k in ("ratio_mean", "clip_fraction")},
        # The train-inference mismatch and the off-policy mask's share, every step; KL only with a reference.
        mismatch_kl=round(stats.figures.get("behaviour_kl", 0.0), 8),
        masked_share=round(stats.figures.get("masked_share", 0.0), 6),
        **({"kl": round(stats.figures["kl"], 8)} if "kl" in stats.figures else {}),
        **({"substeps": stats.substeps} if stats.substeps != 1 else {}),
        # MoE models: the load-balancing loss (1.0 = uniform routing) the step added at [learner] moe_aux_coef.
        **({"moe_aux_loss": round(stats.figures["moe_aux_loss"], 6)} if "moe_aux_loss" in stats.figures else {}),
    )


def _rounded(values: dict[str, float], digits: int) -> dict[str, float]:
    return {k: round(v, digits) for k, v in values.items()}


async def publish_step(
    bus: Bus, stats: StepStats, progress: Progress, *, run_id: str, dropped: dict[str, int], finished_at: float
) -> None:
    """Publish the step's `learner.step` message (counted and logged if it cannot be)."""
    step, version = progress.step, progress.version
    msg = LearnerStep(
        step=step,
        policy_version=version,
        run_id=run_id,
        loss=stats.loss,
        reward_mean=stats.reward_mean,
        accuracy=stats.accuracy,
        n_trajectories=stats.n_trajectories,
        n_groups=stats.n_groups,
        n_tokens=stats.n_tokens,
        grad_norm=stats.grad_norm,
        step_time_s=stats.time_s,
        staleness=stats.staleness,
        dropped=dropped,
        finished_at=finished_at,
        n_samples=stats.n_samples,
        turns_per_episode=stats.episodes.get("turns_per_episode", 0.0),
        tool_calls_per_turn=stats.episodes.get("tool_calls_per_turn", 0.0),
        invalid_call_rate=stats.episodes.get("invalid_call_rate", 0.0),
        samples_per_episode=stats.episodes.get("samples_per_episode", 0.0),
        summaries_per_episode=stats.episodes.get("summaries_per_episode", 0.0),
        tokens_per_episode=stats.episodes.get("tokens_per_episode", 0.0),
        logprob_mismatch_by_turn=stats.mismatch_by_turn,
        reward_weights=stats.reward_weights,
        episode_means=stats.episode_means,
        kl=stats.figures.get("kl"),
        mismatch_kl=stats.figures.get("behaviour_kl", 0.0),
        masked_share=stats.figures.get("masked_share", 0.0),
        substeps=stats.substeps,
        moe_aux_loss=stats.figures.get("moe_aux_loss"),
    )
    # The version is in the id: after a crash a step number is redone, but never a version.
    try:
        await bus.publish(LEARNER_STEP, msg, msg_id=f"{run_id}:step:{step}:v{version}")
    except PublishError as exc:
        PUBLISH_ERRORS.add(1)
        log.warning("learner.step not published", step=step, error=str(exc))
