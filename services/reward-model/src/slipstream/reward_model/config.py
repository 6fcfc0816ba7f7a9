"""Configuration of the reward-model service: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from slipstream.judge.config import JudgeConfig
from slipstream.runtime.base import ServiceConfig
from slipstream.trust.config import ProvenanceConfig

Doc = msgspec.Meta


class RewardSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[reward]`: how many trajectories are scored at once, the environments' options, and rubric judges."""

    concurrency: Annotated[
        int, Doc(description="Trajectories scored and published at once by this replica.", ge=1, le=4096)
    ] = 16
    env_options: Annotated[
        dict[str, dict[str, Any]],
        Doc(
            description=(
                "Options per environment, {env: {option: value}} (e.g. {arith = {max_operand = 19}}); "
                "keep them equal to the task source's. Environments not named use their defaults."
            )
        ),
    ] = {}
    judges: Annotated[
        dict[str, JudgeConfig],
        Doc(
            description=(
                "Rubric judges by name, {name: {url, model, envs, rubric_file, context, k, ...}} (libs/judge README): "
                "each adds a weighted `judge` component to the episodes of its envs. One judge per env."
            )
        ),
    ] = {}

    def check_judges(self) -> None:
        """Raise ValueError naming the judge when one is misconfigured or two claim one env."""
        owner: dict[str, str] = {}
        for name, judge in self.judges.items():
            judge.check(name)
            for env in judge.envs:
                if env in owner:
                    raise ValueError(f"[reward.judges] env {env!r} is claimed by both {owner[env]!r} and {name!r}")
                owner[env] = name


class RewardModelConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    section_docs: ClassVar[dict[str, str]] = {
        "store": "Object store (local directory or S3): by-reference episode bodies.",
    }
    reward: Annotated[
        RewardSection, Doc(description="Scoring: concurrency, per-environment options, rubric judges.")
    ] = msgspec.field(default_factory=RewardSection)
    provenance: Annotated[ProvenanceConfig, Doc(description="The ed25519 key every scored episode is signed with.")] = (
        msgspec.field(default_factory=ProvenanceConfig)
    )
