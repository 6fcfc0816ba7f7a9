"""The one table of subjects, streams and durable consumers, and of request/reply services.

The bus creates streams and consumers from it at start-up, the deploy manifests (KEDA scalers,
the provisioning Job) are checked against it, and `proto/subjects.json` is generated from it.
Request/reply subjects (`REQUESTS`: tool calls) are core NATS, outside every stream: a request
lives only while its caller waits. Change the wire topology here and nowhere else.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta
Retention = Literal["workqueue", "limits", "interest"]


class ConsumerSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A durable pull consumer shared by every replica of one service.

    Ack waits are short on purpose: a consumer that holds a message for long (a rollout, a step
    waiting for its checkpoint) keeps it with in-progress signals every ack_wait/3, so the wait
    only decides how soon a *dead* holder's messages come back to the other replicas.
    """

    durable: Annotated[str, Doc(description="Durable name; replicas bind to the same one.")]
    filter_subject: str
    service: Annotated[str, Doc(description="The service whose replicas consume it.")]
    ack_wait_s: Annotated[
        float,
        Doc(
            description="Seconds without an ack or in-progress signal before the server redelivers "
            "(how long a dead holder's messages stay locked)."
        ),
    ] = 10.0
    max_deliver: Annotated[int, Doc(description="Deliveries before the message goes to the DLQ.")] = 5
    max_ack_pending: int = 1024
    replies_to: Annotated[
        tuple[str, ...],
        Doc(
            description="Services whose reply inboxes (`_INBOX.<service>.>`) this consumer's service may publish "
            "to: a request carried by a work queue, answered on core NATS (the sub-agent pool)."
        ),
    ] = ()


class SubjectSpec(msgspec.Struct, kw_only=True, frozen=True):
    pattern: Annotated[str, Doc(description="NATS subject or wildcard pattern.")]
    message: Annotated[str, Doc(description="Schema name of the message type carried.")]
    stream: str
    description: str = ""
    upgrades_from: Annotated[
        tuple[str, ...],
        Doc(description="Older message types still admitted here, converted on decode (codec.UPGRADES)."),
    ] = ()
    publishers: Annotated[
        tuple[str, ...],
        Doc(description="Services allowed to publish here (their bus users get nothing else to publish)."),
    ] = ()
    readers: Annotated[
        tuple[str, ...],
        Doc(description="Services that read every message here through a fan-out (ordered, ephemeral) view."),
    ] = ()


class RequestSpec(msgspec.Struct, kw_only=True, frozen=True):
    """A request/reply service on core NATS: replicas share a queue group, no stream holds requests."""

    pattern: Annotated[str, Doc(description="Subject pattern requests are sent to.")]
    request: Annotated[str, Doc(description="Schema name of the request type.")]
    reply: Annotated[str, Doc(description="Schema name of the reply type.")]
    queue_group: Annotated[str, Doc(description="Queue group every replica subscribes in (one answers).")]
    service: Annotated[str, Doc(description="The service whose replicas answer.")]
    description: str = ""
    callers: Annotated[
        tuple[str, ...], Doc(description="Services allowed to send requests here (their bus users may publish them).")
    ] = ()


class StreamSpec(msgspec.Struct, kw_only=True, frozen=True):
    name: str
    retention: Retention
    storage: Literal["file", "memory"] = "file"
    max_age_s: Annotated[float, Doc(description="0 keeps messages until acked/limits.")] = 0.0
    max_bytes: Annotated[int, Doc(description="-1 for unlimited.")] = -1
    duplicate_window_s: Annotated[float, Doc(description="Nats-Msg-Id dedup window.")] = 120.0
    consumers: tuple[ConsumerSpec, ...] = ()
    description: str = ""


DAY = 86400.0

SUBJECTS: tuple[SubjectSpec, ...] = (
    SubjectSpec(
        pattern="tasks.>",
        message="Task",
        stream="TASKS",
        description="tasks.<env>: prompts to roll out",
        publishers=("task-source",),
    ),
    SubjectSpec(
        pattern="traj.raw.>",
        message="Episode",
        stream="TRAJ_RAW",
        description="traj.raw.<env>: unscored episodes",
        upgrades_from=("Trajectory",),
        publishers=("rollout-worker",),
    ),
    SubjectSpec(
        pattern="traj.scored.>",
        message="ScoredEpisode",
        stream="TRAJ_SCORED",
        description="traj.scored.<env>: episodes with rewards",
        upgrades_from=("ScoredTrajectory",),
        publishers=("reward-model",),
    ),
    SubjectSpec(
        pattern="weights.announce",
        message="WeightAnnounce",
        stream="WEIGHTS",
        description="a version is stored",
        publishers=("weight-publisher",),
        readers=("rollout-worker", "learner", "task-source", "subagent-pool"),
    ),
    SubjectSpec(
        pattern="weights.promoted",
        message="WeightsPromoted",
        stream="WEIGHTS",
        description="serving version",
        publishers=("eval-gate",),
        readers=("rollout-worker", "eval-gate"),
    ),
    SubjectSpec(
        pattern="eval.result",
        message="EvalResult",
        stream="EVAL",
        description="eval-gate decisions",
        publishers=("eval-gate",),
    ),
    SubjectSpec(
        pattern="learner.step",
        message="LearnerStep",
        stream="LEARNER",
        description="per-step metrics",
        publishers=("learner",),
        readers=("task-source",),
    ),
    SubjectSpec(
        pattern="subagents.>",
        message="SubagentRequest",
        stream="SUBAGENTS",
        description="subagents.<env>: frozen sub-agent episodes for the pinned pool (reply to the Reply-To inbox)",
        publishers=("rollout-worker",),
    ),
    # Publishers of dlq.<STREAM> are not listed: the consumers of STREAM's durables may dead-letter
    # into it (slipstream.bus.permissions derives that), nobody else.
    SubjectSpec(pattern="dlq.>", message="DeadLetter", stream="DLQ", description="dlq.<stream>: dead letters"),
)

TOOL_QUEUE_GROUP = "tool-service"
SUBAGENT_POOL_DURABLE = "subagent-pool"

REQUESTS: tuple[RequestSpec, ...] = (
    RequestSpec(
        pattern="tools.call.*",
        request="ToolRequest",
        reply="ToolReply",
        queue_group=TOOL_QUEUE_GROUP,
        service="tool-service",
        description="tools.call.<tool>: one tool call, answered by one tool-service replica",
        callers=("rollout-worker", "subagent-pool"),
    ),
)

STREAMS: tuple[StreamSpec, ...] = (
    StreamSpec(
        name="TASKS",
        retention="workqueue",
        consumers=(
            ConsumerSpec(durable="rollout-worker", filter_subject="tasks.>", service="rollout-worker", ack_wait_s=10.0),
        ),
        description="Task backlog; each task is taken by exactly one rollout worker.",
    ),
    StreamSpec(
        name="TRAJ_RAW",
        retention="workqueue",
        consumers=(
            ConsumerSpec(durable="reward-model", filter_subject="traj.raw.>", service="reward-model", ack_wait_s=10.0),
        ),
        description="Raw trajectories waiting to be scored.",
    ),
    StreamSpec(
        name="TRAJ_SCORED",
        retention="workqueue",
        consumers=(
            ConsumerSpec(
                durable="learner",
                filter_subject="traj.scored.>",
                service="learner",
                ack_wait_s=20.0,
                max_ack_pending=65536,
            ),
        ),
        description="Scored trajectories; acked by the learner after the step that used them commits.",
    ),
    StreamSpec(
        name="WEIGHTS",
        retention="limits",
        max_age_s=7 * DAY,
        consumers=(
            ConsumerSpec(durable="eval-gate", filter_subject="weights.announce", service="eval-gate", ack_wait_s=30.0),
        ),
        description="Weight announcements and promotions: a replayable log.",
    ),
    StreamSpec(
        name="SUBAGENTS",
        retention="workqueue",
        # A request lives as long as its requester waits (it retries with a new message after that).
        max_age_s=600.0,
        consumers=(
            ConsumerSpec(
                durable=SUBAGENT_POOL_DURABLE,
                filter_subject="subagents.>",
                # The rollout-worker image run as the pool (its own NATS user: it answers inboxes).
                service="subagent-pool",
                ack_wait_s=10.0,
                max_deliver=3,
                replies_to=("rollout-worker",),
            ),
        ),
        description="Sub-agent requests; each is played by exactly one worker of the pinned pool.",
    ),
    StreamSpec(name="EVAL", retention="limits", max_age_s=30 * DAY, description="Eval results log."),
    StreamSpec(name="LEARNER", retention="limits", max_age_s=7 * DAY, description="Learner step metrics log."),
    StreamSpec(name="DLQ", retention="limits", max_age_s=14 * DAY, description="Dead letters with their reasons."),
)


def stream(name: str) -> StreamSpec:
    for s in STREAMS:
        if s.name == name:
            return s
    raise KeyError(f"unknown stream {name!r}; known: {[s.name for s in STREAMS]}")


def consumer(durable: str) -> tuple[StreamSpec, ConsumerSpec]:
    for s in STREAMS:
        for c in s.consumers:
            if c.durable == durable:
                return s, c
    raise KeyError(f"unknown durable consumer {durable!r}")


def subjects_of(stream_name: str) -> list[str]:
    return [s.pattern for s in SUBJECTS if s.stream == stream_name]


def _matches(pattern: str, subject: str) -> bool:
    p, s = pattern.split("."), subject.split(".")
    for i, tok in enumerate(p):
        if tok == ">":
            return len(s) > i
        if i >= len(s) or (tok != "*" and tok != s[i]):
            return False
    return len(p) == len(s)


def spec_for(subject: str) -> SubjectSpec:
    """The table row whose pattern matches a concrete subject."""
    for s in SUBJECTS:
        if _matches(s.pattern, subject):
            return s
    raise KeyError(f"subject {subject!r} is not in the subject table")


def dlq_subject(stream_name: str) -> str:
    return f"dlq.{stream_name}"


def tasks_subject(env: str) -> str:
    return f"tasks.{env}"


def traj_raw_subject(env: str) -> str:
    return f"traj.raw.{env}"


def traj_scored_subject(env: str) -> str:
    return f"traj.scored.{env}"


def tool_subject(tool: str) -> str:
    """Where calls of `tool` are sent (`tools.call.<tool>`); the tool name is one subject token."""
    if not tool or any(c in tool for c in ".*> \t\r\n"):
        raise ValueError(f"tool name {tool!r} is not a single NATS subject token")
    return f"tools.call.{tool}"


def subagent_subject(env: str) -> str:
    """Where sub-agent requests for env `env` go (`subagents.<env>`, stream SUBAGENTS)."""
    if not env or any(c in env for c in ".*> \t\r\n"):
        raise ValueError(f"env name {env!r} is not a single NATS subject token")
    return f"subagents.{env}"


WEIGHTS_ANNOUNCE = "weights.announce"
WEIGHTS_PROMOTED = "weights.promoted"
EVAL_RESULT = "eval.result"
LEARNER_STEP = "learner.step"
