"""Configuration of the eval-gate service: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order. `[model]`
is the shared `slipstream.engine.source.ModelSource` (the gate loads the same architecture and
tokenizer as the workers, then applies each candidate's weights); `[summary]` is the harness's
`SummaryConfig`, the same section (and the same SLIPSTREAM_SUMMARY__* variables) the rollout
workers read, so a candidate is evaluated with the context restarts it was trained with; `[gate]`
is this service's own.
Lists and tables given as variables or flags are JSON: `SLIPSTREAM_GATE__ENVS='["arith"]'`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec

from slipstream.engine.source import ModelSource
from slipstream.harness.summary import SummaryConfig
from slipstream.runtime.base import ServiceConfig
from slipstream.trust.config import TrustConfig

Doc = msgspec.Meta
# The suite name is part of an object-store key and of a NATS msg id.
_SUITE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


class GateSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[gate]`: which versions are evaluated, on what pinned suite, and the promotion rule."""

    envs: Annotated[list[str], Doc(description="Environments whose held-out split forms the suite.")] = msgspec.field(
        default_factory=lambda: ["arith"]
    )
    env_options: Annotated[
        dict[str, dict[str, Any]],
        Doc(description='Options per environment, e.g. {"arith": {"max_operand": 19}}; keep equal to training.'),
    ] = {}
    suite: Annotated[str, Doc(description="Name of the suite in eval.result and in the details' object key.")] = (
        "heldout"
    )
    every_n_versions: Annotated[
        int, Doc(description="Evaluate versions divisible by N (version 0 always); others are acked unevaluated.", ge=1)
    ] = 1
    suite_size: Annotated[
        int, Doc(description="Held-out tasks per environment (fixed: the same every time).", ge=1)
    ] = 64
    suite_sizes: Annotated[
        dict[str, int],
        Doc(description='Per-environment suite_size, e.g. {"humaneval": 164} beside a smaller training env\'s.'),
    ] = {}
    report_only: Annotated[
        list[str],
        Doc(
            description="Environments of envs that are evaluated and reported (eval details, per-env summary) "
            "but kept out of the promotion decision, e.g. an eval suite like humaneval."
        ),
    ] = []
    samples_per_task: Annotated[
        int, Doc(description="Completions sampled per task; a task's score is their mean.", ge=1)
    ] = 1
    seed: Annotated[int, Doc(description="Seed of the suite's tasks and of the sampling (fixed seeds).")] = 0
    metric: Annotated[
        Literal["reward", "accuracy"], Doc(description="Per-sample score: the env's reward, or 1/0 correctness.")
    ] = "reward"
    margin: Annotated[
        float, Doc(description="Largest tolerated drop vs the promoted version (non-inferiority margin).", ge=0)
    ] = 0.05
    confidence: Annotated[float, Doc(description="Two-sided confidence of the intervals, in (0, 1).", gt=0, lt=1)] = (
        0.95
    )
    floor: Annotated[float, Doc(description="Absolute minimum mean score a promoted version must reach.")] = 0.0
    min_samples: Annotated[int, Doc(description="Fewest tasks a decision may rest on (>= 2).", ge=2)] = 8
    max_tokens: Annotated[
        int, Doc(description="Most tokens per generation; 0 = the env's longest sensible answer.", ge=0)
    ] = 0
    temperature: Annotated[float, Doc(description="Sampling temperature; 0 = greedy (deterministic).", ge=0)] = 0.0
    max_batch: Annotated[int, Doc(description="Engine slots: completions decoded together.", ge=1)] = 64
    skip_superseded: Annotated[
        bool,
        Doc(description="Of several due announcements fetched together, evaluate only the newest (ack the rest)."),
    ] = True
    retry_delay_s: Annotated[
        float, Doc(description="Redelivery delay of an announcement that could not be evaluated (Redis down).", ge=0)
    ] = 5.0
    control_timeout_s: Annotated[float, Doc(description="Bound on each Redis operation.", gt=0)] = 2.0

    def __post_init__(self) -> None:
        if not self.envs:
            raise ValueError("[gate] envs must name at least one environment")
        if not _SUITE.fullmatch(self.suite):
            raise ValueError(f"[gate] suite {self.suite!r} must match {_SUITE.pattern} (it is part of keys and ids)")
        unknown = sorted(set(self.env_options) - set(self.envs))
        if unknown:
            raise ValueError(f"[gate] env_options names environments not in envs: {', '.join(unknown)}")
        unknown = sorted(set(self.report_only) - set(self.envs))
        if unknown:
            raise ValueError(f"[gate] report_only names environments not in envs: {', '.join(unknown)}")
        if set(self.report_only) >= set(self.envs):
            raise ValueError("[gate] report_only covers every env of envs: nothing would decide a promotion")
        unknown = sorted(set(self.suite_sizes) - set(self.envs))
        if unknown:
            raise ValueError(f"[gate] suite_sizes names environments not in envs: {', '.join(unknown)}")
        small = sorted(name for name, size in self.suite_sizes.items() if size < 1)
        if small:
            sizes = ", ".join(f"{n}={self.suite_sizes[n]}" for n in small)
            raise ValueError(f"[gate] suite_sizes must be >= 1, got {sizes}")

    def size_of(self, env: str) -> int:
        """Held-out tasks of `env` in the suite."""
        return self.suite_sizes.get(env, self.suite_size)


class EvalGateConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    model: Annotated[
        ModelSource, Doc(description="Architecture, tokenizer, dtype, device, threads (weights come per version).")
    ] = msgspec.field(default_factory=ModelSource)
    gate: Annotated[GateSection, Doc(description="Versions evaluated, the pinned suite, the promotion rule.")] = (
        msgspec.field(default_factory=GateSection)
    )
    summary: Annotated[
        SummaryConfig,
        Doc(
            description="Context restarts of the suite's episodes: the run's [rollout.summary], the same section "
            "the rollout workers read (off by default)."
        ),
    ] = msgspec.field(default_factory=SummaryConfig)
    trust: Annotated[TrustConfig, Doc(description="Public keys a candidate version must be signed with.")] = (
        msgspec.field(default_factory=TrustConfig)
    )
