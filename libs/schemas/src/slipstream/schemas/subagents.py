"""Sub-agent rollouts on the wire: what an orchestrator's worker asks the sub-agent pool, and the answer.

A frozen sub-agent (`spawn(..., trainable=False)`) may run outside the orchestrator's worker, in
a pool of rollout workers pinned to one weight version. The request names everything the pool
needs to rebuild the child exactly: the registered environment and its options (plain data), the
child's task, the sampling parameters and seed. It goes to the `SUBAGENTS` work-queue stream
(subjects.py), so the backlog is a consumer lag an autoscaler can read; the reply goes straight
to the requester's inbox (named in the `Slipstream-Reply-To` header), never into a stream.

`request_id` (the parent episode id + the child's agent id) is the idempotency key: a pool worker
that already served it answers from memory, and the requester keeps exactly one reply. A reply
with `error` set is an infrastructure failure (the pool could not serve the child), never the
model's fault: the parent episode is masked, not scored.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec

from slipstream.schemas.episode import Sample, ToolEvent

Doc = msgspec.Meta

REPLY_TO_HEADER = "Slipstream-Reply-To"


class SubagentSampling(msgspec.Struct, kw_only=True):
    """The parent's sampling parameters, copied to the child (seeds are derived per call)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 32
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False


class SubagentRequest(msgspec.Struct, kw_only=True):
    """One frozen sub-agent episode to play, as the orchestrator's worker asks the pool for it."""

    SCHEMA: ClassVar[str] = "SubagentRequest"
    VERSION: ClassVar[int] = 1

    request_id: Annotated[str, Doc(description="Parent episode id + '/' + the child's agent id: the idempotency key.")]
    run_id: Annotated[str, Doc(description="The training run (the pool serves one run's pinned version).")] = ""
    parent_episode_id: Annotated[str, Doc(description="The episode the child's samples join.")] = ""
    agent_id: Annotated[str, Doc(description="The child's agent id, kept on its samples and tool events.")] = ""
    role: Annotated[str, Doc(description="The child's sample role (default 'subagent').")] = "subagent"
    env: Annotated[str, Doc(description="Registered environment name of the child.")] = ""
    env_options: Annotated[
        dict[str, Any], Doc(description="The child env's options as plain data (msgspec.to_builtins(env.options)).")
    ] = {}
    task_id: Annotated[str, Doc(description="The child TaskSpec's task_id.")] = ""
    prompt: Annotated[str, Doc(description="The child TaskSpec's prompt.")] = ""
    reference: Annotated[str, Doc(description="The child TaskSpec's reference (never shown to the model).")] = ""
    task_seed: Annotated[int, Doc(description="The child TaskSpec's seed.")] = 0
    split: Annotated[str, Doc(description="The child TaskSpec's split: 'train' or 'heldout'.")] = "train"
    metadata: Annotated[dict[str, str], Doc(description="The child TaskSpec's metadata.")] = {}
    sampling: Annotated[SubagentSampling, Doc(description="Sampling parameters of every child turn.")] = msgspec.field(
        default_factory=SubagentSampling
    )
    seed: Annotated[
        int, Doc(description="Base seed of the child's engine calls (derived from the parent's group and turn).")
    ] = 0
    deadline: Annotated[
        float, Doc(description="Unix time after which the requester no longer waits; the pool skips it then. 0: none.")
    ] = 0.0
    attempt: Annotated[int, Doc(description="1 for the first send of this request_id, then 2, 3, ...")] = 1
    caller: Annotated[str, Doc(description="The requesting worker's id, for logs.")] = ""


class SubagentReply(msgspec.Struct, kw_only=True):
    """The pool's answer: the child's samples and tool events, counts and outcome, or an error."""

    SCHEMA: ClassVar[str] = "SubagentReply"
    VERSION: ClassVar[int] = 1

    request_id: Annotated[str, Doc(description="The request's request_id.")]
    samples: Annotated[
        list[Sample], Doc(description="The child's samples, ids local to the child (the parent renumbers them).")
    ] = []
    tool_log: Annotated[list[ToolEvent], Doc(description="The child's tool calls, sample ids as in `samples`.")] = []
    counts: Annotated[dict[str, int], Doc(description="The child's episode counts (turns, tool_calls, ...).")] = {}
    final_text: Annotated[str, Doc(description="The child's final message (what spawn returns).")] = ""
    finish_reason: Annotated[str, Doc(description="Why the child's episode ended.")] = ""
    steps: Annotated[
        int, Doc(description="Steps the child took: tool invocations, plus 1 for each turn without a call.")
    ] = 0
    policy_version: Annotated[
        int, Doc(description="The pinned weight version that served the child (-1 when nothing was served).")
    ] = -1
    worker_id: Annotated[str, Doc(description="The pool worker that played the child.")] = ""
    error: Annotated[
        str, Doc(description="Why the pool could not serve the child (an infra error: masks the episode); '' = ok.")
    ] = ""
    replayed: Annotated[bool, Doc(description="Answered from the worker's memory of this request_id.")] = False
    elapsed_s: Annotated[float, Doc(description="Seconds the pool worker spent playing the child.")] = 0.0
