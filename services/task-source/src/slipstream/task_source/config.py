"""Configuration of the task source: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order. Lists and
tables given as variables or flags are JSON: `SLIPSTREAM_TASKS__ENVS='["arith","reverse"]'`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from slipstream.runtime.base import ServiceConfig
from slipstream.trust.config import TrustConfig

Doc = msgspec.Meta


class TasksSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[tasks]`: what to generate, how far ahead of the learner, and when to stop."""

    envs: Annotated[
        list[str], Doc(description="Environments to draw tasks from, round-robin (names in the env registry).")
    ] = msgspec.field(default_factory=lambda: ["arith"])
    env_options: Annotated[
        dict[str, dict[str, Any]],
        Doc(description="Options per environment, {env: {option: value}}; keep equal to the reward model's."),
    ] = {}
    group_size: Annotated[int, Doc(description="Completions sampled per task (one group per task).", ge=1)] = 8
    groups_per_step: Annotated[
        int,
        Doc(description="Groups the learner trains on per optimizer step (same as [learner] groups_per_step).", ge=1),
    ] = 4
    max_staleness: Annotated[
        int,
        Doc(
            description="Versions a rollout may lag the learner (same as [learner]); 0 is the synchronous baseline.",
            ge=0,
        ),
    ] = 2
    max_steps: Annotated[
        int,
        Doc(description="Stop once the learner reports this step (same as [learner] max_steps); 0 never stops.", ge=0),
    ] = 0
    seed: Annotated[int, Doc(description="Seed of task generation; with the run id it fixes every task id.")] = 0
    split: Annotated[Literal["train", "heldout"], Doc(description="Split the tasks are drawn from.")] = "train"
    poll_interval_s: Annotated[
        float, Doc(description="Pause between two looks at the backlog (stream info of three streams).", gt=0)
    ] = 0.1
    learner_checkpoint_every: Annotated[
        int,
        Doc(
            description=(
                "The learner's checkpoint_every: trajectories it trained since its last checkpoint keep their "
                "acks (so they look outstanding) and are not counted against the window."
            ),
            ge=1,
        ),
    ] = 1
    sync_timeout_s: Annotated[
        float,
        Doc(description="At start, longest wait for the last learner.step / weights.announce already stored.", ge=0),
    ] = 2.0

    skip_min_attempts: Annotated[
        int,
        Doc(
            description="Difficulty filter ([service] redis_url): skip a task once it has this many scored attempts "
            "and is always or never solved; 0 = filter off.",
            ge=0,
        ),
    ] = 0
    skip_solved_above: Annotated[
        float,
        Doc(description="Skip a task as always_solved when its solve rate is at or above this.", ge=0, le=1),
    ] = 1.0
    skip_solved_below: Annotated[
        float,
        Doc(description="Skip a task as never_solved when its solve rate is at or below this.", ge=0, le=1),
    ] = 0.0

    sampler: Annotated[
        Literal["off", "pass_rate"],
        Doc(
            description="pass_rate ([service] redis_url): serve again tasks whose latest group was informative, "
            "retire those solved every time (sampler.py); off: every task fresh from the generator."
        ),
    ] = "off"
    sampler_revisit_share: Annotated[
        float,
        Doc(description="Pass-rate sampler: chance that a task to publish is a revisit (when one beats a fresh task)."),
    ] = 1.0
    sampler_retire_above: Annotated[
        float, Doc(description="Pass-rate sampler: retire a task whose latest group passed at or above this.")
    ] = 0.9
    sampler_never_weight: Annotated[
        float, Doc(description="Pass-rate sampler: weight of a task whose latest group was never solved (mixed: <= 1).")
    ] = 0.05
    sampler_max_serves: Annotated[
        int, Doc(description="Pass-rate sampler: most times one task is served (a bound on memorising it).", ge=1)
    ] = 8
    sampler_pool_size: Annotated[
        int, Doc(description="Pass-rate sampler: tasks remembered (the oldest are forgotten first).", ge=1)
    ] = 4096
    sampler_pending_timeout_s: Annotated[
        float, Doc(description="Pass-rate sampler: stop waiting for a group's result after this long.", gt=0)
    ] = 120.0

    def __post_init__(self) -> None:
        if not self.envs:
            raise ValueError("[tasks] envs must name at least one environment")
        if self.skip_min_attempts and not self.skip_solved_below < self.skip_solved_above:
            raise ValueError(
                f"[tasks] skip_solved_below ({self.skip_solved_below}) must be below skip_solved_above "
                f"({self.skip_solved_above})"
            )
        if not 0.0 <= self.sampler_revisit_share <= 1.0:
            raise ValueError(f"[tasks] sampler_revisit_share must be in [0, 1], got {self.sampler_revisit_share}")
        if not 0.0 < self.sampler_retire_above <= 1.0:
            raise ValueError(f"[tasks] sampler_retire_above must be in (0, 1], got {self.sampler_retire_above}")
        if not 0.0 <= self.sampler_never_weight <= 1.0:
            raise ValueError(f"[tasks] sampler_never_weight must be in [0, 1], got {self.sampler_never_weight}")


class TaskSourceConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    section_docs: ClassVar[dict[str, str]] = {
        "store": "Object store (local directory or S3) announced manifests are checked in.",
    }
    tasks: Annotated[TasksSection, Doc(description="Task generation, pacing and the stop condition.")] = msgspec.field(
        default_factory=TasksSection
    )
    trust: Annotated[TrustConfig, Doc(description="Public keys an announced version must be signed with.")] = (
        msgspec.field(default_factory=TrustConfig)
    )

    def __post_init__(self) -> None:
        if self.tasks.sampler != "off" and not self.service.redis_url:
            raise ValueError(
                f"[tasks] sampler = {self.tasks.sampler!r} reads the task statistics in Redis: set [service] redis_url"
            )
