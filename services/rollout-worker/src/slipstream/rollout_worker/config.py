"""Configuration of the rollout-worker service: one typed class on `ServiceConfig`.

`slipstream.runtime.base.ServiceConfig` holds the shared sections ([service], [bus], [store],
[telemetry]), each owned by its lib; this module adds the service's own.

Resolved by `slipstream.runtime.config` from defaults, a TOML file (`--config`),
`SLIPSTREAM_<SECTION>__<FIELD>` variables and `--section.field` flags, in that order. `[model]`
is the shared `slipstream.engine.source.ModelSource`; `[worker]` is this service's own.
`[engine]` picks the engine: `torch` in this process (default), or `http`, a Slipstream inference
server at `url` (then `[model]` only names the tokenizer, and the server holds the weights).
`[summary]` is the harness's `SummaryConfig`: self-summarising context restarts (or the
truncation baseline) for every episode this worker plays (a run file's `[rollout.summary]`).
`[subagents]` says where frozen sub-agents run (a local frozen copy of the weights, or the pool);
`[pool] subagents = true` turns the worker into a replica of that pool, pinned to `pin_version`.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec

from slipstream.engine.backend import EngineBackend
from slipstream.engine.source import ModelSource
from slipstream.harness.summary import SummaryConfig
from slipstream.runtime.base import ServiceConfig
from slipstream.serve.config import ServeConfig
from slipstream.toolcalls.config import ToolsConfig
from slipstream.trust.config import TrustConfig

Doc = msgspec.Meta


class WorkerSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[worker]`: how tasks are taken, sampled and handed on, and how weights are followed."""

    max_batch: Annotated[int, Doc(description="Engine slots: completions decoded together in one batch.", ge=1)] = 32
    max_seq_len: Annotated[
        int, Doc(description="Longest prompt + completion in the engine; 0 = the model's (at most 2048).", ge=0)
    ] = 0
    max_tasks_in_flight: Annotated[
        int,
        Doc(description="Tasks taken from the shared consumer and not yet acked (each is group_size requests).", ge=1),
    ] = 8
    temperature: Annotated[
        float, Doc(description="Sampling temperature; the learner must use the same one for its log-probs.", ge=0)
    ] = 1.0
    top_p: Annotated[float, Doc(description="Nucleus mass kept, in (0, 1]; 1 disables.", gt=0, le=1)] = 1.0
    top_k: Annotated[int, Doc(description="Sample from the k most likely tokens; 0 disables.", ge=0)] = 0
    max_tokens: Annotated[int, Doc(description="Most tokens one generation (one turn) may produce.", ge=1)] = 32
    screen_target: Annotated[
        float,
        Doc(
            description="Before sampling a task's group, keep the task with probability min(1, P(mixed) / "
            "screen_target), P(mixed) = 1 - p^G - (1-p)^G from p, the chance one sample writes the reference "
            "(one teacher-forced forward); a task not kept is acked without a group (outcome screened). "
            "Single-turn envs with a reference, on the torch engine; 0 = off (screen.py).",
            ge=0,
            le=1,
        ),
    ] = 0.0
    stop: Annotated[list[str], Doc(description="Extra stop strings for every generation.")] = []
    stop_at_terminator: Annotated[
        bool, Doc(description="Also stop each generation at the environment's answer terminator (arith: newline).")
    ] = True
    ignore_eos: Annotated[bool, Doc(description="Generate past eos up to max_tokens (benchmarks and tests only).")] = (
        False
    )
    follow: Annotated[
        Literal["latest", "promoted"],
        Doc(
            description=(
                "Which weights to follow: 'latest' (every weights.announce of this run: training) or 'promoted' "
                "(only weights.promoted, including rollbacks to older versions: serving)."
            )
        ),
    ] = "latest"
    recompute_kv_on_update: Annotated[
        bool, Doc(description="Recompute running rows' KV caches under new weights (default keeps them).")
    ] = False
    speculative_tokens: Annotated[
        int,
        Doc(
            description="Speculative decoding: draft this many tokens per step with the model's MTP modules "
            "(needs [model] weights with mtp_depth >= it; the sampled distribution is unchanged); 0 = off.",
            ge=0,
        ),
    ] = 0
    weights_digest: Annotated[
        bool,
        Doc(description="After each applied version, report a sha256 of the engine weights on /readyz (tests)."),
    ] = False
    weight_fetch_retries: Annotated[
        int, Doc(description="Retries of a failed weight fetch before the version is skipped.", ge=0)
    ] = 3
    weight_fetch_backoff_s: Annotated[
        float, Doc(description="First pause between weight fetch retries (doubles each retry).", ge=0)
    ] = 0.5
    weight_apply_timeout_s: Annotated[
        float,
        Doc(
            description="Longest wait for the engine to switch to a fetched version before it is counted skipped "
            "(vLLM first waits for the requests in flight; raise it for vLLM on a loaded machine).",
            gt=0,
        ),
    ] = 60.0
    version_wait_timeout_s: Annotated[
        float, Doc(description="Longest wait for the engine to reach a task's min_policy_version before a nak.", gt=0)
    ] = 120.0
    retry_delay_s: Annotated[
        float, Doc(description="Redelivery delay of a task handed back after a failure (version wait, publish).", ge=0)
    ] = 2.0
    heartbeat_s: Annotated[
        float,
        Doc(
            description="Interval of in-progress signals on held tasks; must be under half the `rollout-worker` "
            "durable's ack_wait (10 s), which is how soon a dead worker's tasks come back.",
            gt=0,
        ),
    ] = 3.0
    env_options: Annotated[
        dict[str, dict[str, Any]],
        Doc(description='Options per environment, e.g. {"arith": {"max_operand": 19}}; others use defaults.'),
    ] = {}


class PoolSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[pool]`: this worker is a replica of the sub-agent pool, pinned to one weight version."""

    subagents: Annotated[
        bool,
        Doc(
            description="Serve frozen sub-agent requests (stream SUBAGENTS, durable `subagent-pool`) instead of "
            "tasks; the engine loads exactly `pin_version` and never applies an announcement."
        ),
    ] = False
    pin_version: Annotated[
        int,
        Doc(description="The version the pool serves: 0 = [model]'s initial weights, N = version N of this run.", ge=0),
    ] = 0
    max_in_flight: Annotated[
        int, Doc(description="Sub-agent requests played at once (each is one child episode).", ge=1)
    ] = 16
    replay_cache: Annotated[
        int, Doc(description="Finished replies remembered by request id, answered again without replaying.", ge=0)
    ] = 1024
    pin_wait_s: Annotated[
        float,
        Doc(description="How long start-up waits for `pin_version` to appear in the store before failing.", ge=0),
    ] = 60.0


class SubagentsSection(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """`[subagents]`: where this worker's frozen sub-agents (spawn with trainable=False) run."""

    transport: Annotated[
        Literal["local", "nats"],
        Doc(
            description="'local': in this worker, on a second engine holding a frozen copy of the weights "
            "(`pin_version`) that announcements never touch; 'nats': the pinned sub-agent pool over NATS."
        ),
    ] = "local"
    pin_version: Annotated[
        int,
        Doc(
            description="local: the frozen copy's version: -1 = the first version this worker loads ([model]), "
            "N = version N of this run from the store. nats: the version the pool must serve (-1 = 0); a reply "
            "played on another is rejected (an infra error on the episode).",
            ge=-1,
        ),
    ] = -1
    timeout_s: Annotated[
        float, Doc(description="nats: longest wait for one sub-agent's reply before the request is sent again.", gt=0)
    ] = 120.0
    retries: Annotated[
        int, Doc(description="nats: re-sends after a timeout; then the episode gets an infra error (masked).", ge=0)
    ] = 1
    retry_backoff_s: Annotated[
        float, Doc(description="nats: pause before the first re-send (doubles each time).", ge=0)
    ] = 0.5


class RolloutWorkerConfig(ServiceConfig, kw_only=True, forbid_unknown_fields=True):
    section_docs: ClassVar[dict[str, str]] = {
        "store": "Object store (local directory or S3) the weights are read from.",
    }
    model: Annotated[
        ModelSource, Doc(description="Initial weights (version 0), tokenizer, dtype, device, threads.")
    ] = msgspec.field(default_factory=ModelSource)
    engine: Annotated[
        EngineBackend,
        Doc(description="Which engine samples: in-process torch, or an inference server over HTTP (type, url)."),
    ] = msgspec.field(default_factory=EngineBackend)
    worker: Annotated[WorkerSection, Doc(description="Task intake, sampling and weight following.")] = msgspec.field(
        default_factory=WorkerSection
    )
    tools: Annotated[
        ToolsConfig, Doc(description="Where the environments' tool calls run: in-process, or the tool-service.")
    ] = msgspec.field(default_factory=ToolsConfig)
    trust: Annotated[TrustConfig, Doc(description="Public keys a weight version must be signed with.")] = msgspec.field(
        default_factory=TrustConfig
    )
    summary: Annotated[
        SummaryConfig,
        Doc(description="Context restarts past a per-group token threshold: self-summaries, or truncation (off)."),
    ] = msgspec.field(default_factory=SummaryConfig)
    endpoint: Annotated[
        ServeConfig,
        Doc(description="The OpenAI-compatible endpoint of a serving worker (off unless enabled); calls are recorded."),
    ] = msgspec.field(default_factory=ServeConfig)
    subagents: Annotated[
        SubagentsSection,
        Doc(description="Where frozen sub-agents run: a frozen local copy of the weights, or the pinned pool."),
    ] = msgspec.field(default_factory=SubagentsSection)
    pool: Annotated[
        PoolSection, Doc(description="Run as a sub-agent pool replica pinned to one version (off unless subagents).")
    ] = msgspec.field(default_factory=PoolSection)
