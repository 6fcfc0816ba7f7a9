"""Reward schedules: named reward components re-weighted by learner step (PARL's annealed λ).

An environment scores an episode with named components that sum to its reward (the swarm env:
`perf`, `parallel`, `finish`, each raw and unweighted). Some of them are scaffolding: Kimi K2.5's
PARL adds λ1·r_parallel + λ2·r_finish to the task reward early in training so the orchestrator
neither collapses to serial work nor spawns idle sub-agents, and anneals both λ to zero so the
final policy optimises the task alone. The weights live here, keyed by the learner step, because
only the learner knows the step: the environment and the reward-model stay unchanged while the
weights move, and a resumed learner needs nothing new in its checkpoint (λ is a pure function of
the step).

The reward the learner trains on at step t (the count of optimizer steps already taken, so the
first step is t = 0):

    R'(t) = reward + Σ_c (λ_c(t) − 1) · components[c]

over the scheduled components c; an unscheduled component keeps weight 1, and a scheduled one
the episode's score does not name counts as 0 (reported by the caller, never an error). With no
schedule R' is the scored reward itself, bit for bit.

λ_c(t) goes from `init` at `start_step` to `final` at `start_step + anneal_steps`, by a linear or
half-cosine ramp, and is `final` itself (not a float near it) from then on; before `start_step` it
is `init`. Both shapes are monotone between the two values. Importable without torch: the
learner's config embeds `ComponentSchedule`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

Shape = Literal["linear", "cosine"]
SHAPES: tuple[Shape, ...] = ("linear", "cosine")


class ComponentSchedule(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[learner.reward_schedule.<component>]`: the weight λ of one reward component by learner step."""

    init: Annotated[float, Doc(description="λ at (and before) start_step.")]
    final: Annotated[float, Doc(description="λ from start_step + anneal_steps on, exactly.")] = 0.0
    anneal_steps: Annotated[int, Doc(description="Steps from init to final; 0 = a jump to final at start_step.")] = 0
    shape: Annotated[Shape, Doc(description="Ramp from init to final: 'linear' or 'cosine' (half a cosine).")] = (
        "linear"
    )
    start_step: Annotated[int, Doc(description="Learner step at which the ramp starts (λ = init before it).")] = 0

    def __post_init__(self) -> None:
        # msgspec checks types when decoding a config; a schedule built in code is checked here too.
        if not (math.isfinite(self.init) and math.isfinite(self.final)):
            raise ValueError(f"init and final must be finite, got init={self.init}, final={self.final}")
        if self.anneal_steps < 0:
            raise ValueError(f"anneal_steps must be >= 0, got {self.anneal_steps}")
        if self.start_step < 0:
            raise ValueError(f"start_step must be >= 0, got {self.start_step}")
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; valid: {', '.join(SHAPES)}")

    def at(self, step: int) -> float:
        """λ at learner step `step` (steps already taken; the first step is 0)."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        done = step - self.start_step
        if done < 0:
            return self.init
        if done >= self.anneal_steps:
            return self.final  # exactly: no float drift at the end of the anneal
        frac = done / self.anneal_steps
        keep = 1.0 - frac if self.shape == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return self.final + (self.init - self.final) * keep


RewardSchedule = Mapping[str, ComponentSchedule]
"""Component name -> its schedule (the `[learner.reward_schedule]` table)."""


def check_schedule(schedule: RewardSchedule) -> None:
    """ValueError naming the first bad component name (empty or with surrounding spaces)."""
    for name in schedule:
        if not name or name != name.strip():
            raise ValueError(f"reward_schedule component name must be a non-empty word, got {name!r}")


def weights_at(schedule: RewardSchedule, step: int) -> dict[str, float]:
    """{component: λ} of every scheduled component at learner step `step`."""
    return {name: s.at(step) for name, s in sorted(schedule.items())}


def reweighted(reward: float, components: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """reward + Σ_c (λ_c − 1)·components[c] over the weighted components (a missing one counts 0).

    With no weights, or every λ exactly 1, this is `reward` itself. When the components sum to the
    reward (as a Score's do), the same value is rebuilt from the parts, Σ_c λ_c·components[c] with
    λ = 1 for unweighted ones, correctly rounded (`math.fsum`): an annealed component then leaves
    exactly the others' sum. The literal formula would not (0.3 + 0.6 − 0.6 is 0.29999999999999993),
    and a group differing only in that component would escape the uniform-group screen by 1e-17.
    """
    if all(lam == 1.0 for lam in weights.values()):
        return reward
    parts = math.fsum(components.values())
    if components and math.isclose(parts, reward, rel_tol=1e-9, abs_tol=1e-12):
        return math.fsum(weights.get(name, 1.0) * value for name, value in components.items())
    out = reward
    for name, lam in weights.items():
        value = components.get(name)
        if value is not None and lam != 1.0:
            out += (lam - 1.0) * value
    return out


def missing_components(components: Mapping[str, float], weights: Mapping[str, float]) -> list[str]:
    """The weighted components an episode's score does not name (each counts as 0 in `reweighted`)."""
    return [name for name in weights if name not in components]
