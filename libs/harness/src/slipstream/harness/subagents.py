"""Frozen sub-agents played elsewhere: the request a spawn becomes and the merge back (the pool's side: pool.py).

`Recorder.spawn(..., trainable=False)` runs the child in this process (on `EpisodeRun.frozen_engine`)
unless the episode has a `SubagentTransport` (`EpisodeRun.subagents`); then the child becomes a
`SubagentRequest` and runs in a pool of workers pinned to one version. The environment never knows
which: the child's samples come back into the parent's episode either way, under the child's agent
id, role and trainable=False, its tool events in the parent's tool log (with `agent_id`), its counts
added, and `spawn` returns the child's `Outcome` with `steps` filled in.

Why a request carries data, not objects: the pool rebuilds the child env from its registered name
and plain-data options (`get_env(name, **options)`) and the child task from its fields, so only
envs whose options are plain data can be pooled (every registered env's are msgspec Structs).

The pool's samples are numbered under the request id; `merge_reply` renumbers them into the
parent's sample ids (and their `branch_of` links and tool events with them), so the episode reads
exactly as if the child had run in place. A reply with `error` (the pool could not serve the child
after its retries) becomes an `infra_error` tool event on the parent: the episode is masked, never
scored as a failure of the model, exactly like a tool call no replica answered.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING, Protocol

import msgspec

from slipstream.engine.interface import SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import TaskSpec
from slipstream.envs.context import Nested, Outcome
from slipstream.harness.state import EpisodeState, SampleBuilder
from slipstream.schemas import Sample, SubagentReply, SubagentRequest, SubagentSampling, ToolEvent
from slipstream.schemas.packing import unpack_floats, unpack_ids, unpack_mask

if TYPE_CHECKING:
    pass

SUBAGENT_TOOL = "subagent"
"""The tool name of the infra-error event a failed pool request leaves on the parent episode."""


class SubagentTransport(Protocol):
    """Where frozen sub-agents run when not in this process (the pinned pool over NATS)."""

    async def run(self, request: SubagentRequest) -> SubagentReply:
        """Play one child; a reply with `error` set when it could not be served (never raises for that)."""
        ...


def child_steps(turns: Iterable[int], events: Iterable[ToolEvent]) -> int:
    """Steps of one agent: its tool invocations, plus 1 for each of its turns that made no call."""
    per_turn = Counter(e.turn for e in events)
    own = set(turns)
    return sum(per_turn.values()) + sum(1 for t in own if per_turn.get(t, 0) == 0)


def sampling_of(params: SamplingParams) -> SubagentSampling:
    return SubagentSampling(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
    )


def params_of(sampling: SubagentSampling, seed: int) -> SamplingParams:
    return SamplingParams(
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        max_tokens=sampling.max_tokens,
        stop=list(sampling.stop),
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=sampling.ignore_eos,
        seed=seed,
    )


def build_request(
    env: Nested,
    task: TaskSpec,
    *,
    episode_id: str,
    agent_id: str,
    role: str,
    params: SamplingParams,
    seed: int,
    run_id: str = "",
    caller: str = "",
) -> SubagentRequest:
    """The request that plays `env` on `task` as agent `agent_id` of episode `episode_id`."""
    return SubagentRequest(
        request_id=f"{episode_id}/{agent_id}",
        run_id=run_id,
        parent_episode_id=episode_id,
        agent_id=agent_id,
        role=role,
        env=env.name,
        env_options=msgspec.to_builtins(env.options),
        task_id=task.task_id,
        prompt=task.prompt,
        reference=task.reference,
        task_seed=task.seed,
        split=task.split,
        metadata=dict(task.metadata),
        sampling=sampling_of(params),
        seed=seed,
        caller=caller,
    )


def task_of(request: SubagentRequest) -> TaskSpec:
    """The child's TaskSpec, back from the request (ValueError naming a bad split)."""
    if request.split not in ("train", "heldout"):
        raise ValueError(f"sub-agent request {request.request_id!r} has split {request.split!r}")
    return TaskSpec(
        task_id=request.task_id,
        env=request.env,
        prompt=request.prompt,
        reference=request.reference,
        seed=request.task_seed,
        split=request.split,  # type: ignore[arg-type]  # checked just above
        metadata=dict(request.metadata),
    )


def _builder(sample: Sample, sample_id: str, branch_of: str, tokenizer: Tokenizer) -> SampleBuilder:
    ids = unpack_ids(sample.token_ids)
    return SampleBuilder(
        sample_id=sample_id,
        agent_id=sample.agent_id,
        role=sample.role,
        trainable=False,  # whatever the pool says: a pooled child is frozen by construction
        prompt=ids[: sample.prompt_len],
        tokenizer=tokenizer,
        branch_of=branch_of,
        branch_pos=sample.branch_pos,
        edit=sample.edit,
        after=ids[sample.prompt_len :],
        logprobs=unpack_floats(sample.logprobs),
        mask=unpack_mask(sample.loss_mask),
        segments=[[s.policy_version, s.n_tokens] for s in sample.segments],
        turns=list(sample.turns),
        finish_reason=sample.finish_reason,
        calls=sum(1 for t in sample.turns if t.role == "policy"),
        closed=True,
    )


def merge_reply(tokenizer: Tokenizer, state: EpisodeState, reply: SubagentReply, *, agent_id: str) -> Outcome:
    """Fold a pool's reply into the parent episode and return the child's Outcome (see module doc).

    Synchronous on purpose: concurrent spawns merge one at a time, so sample ids stay contiguous.
    """
    if reply.error:
        state.tool_log.append(
            ToolEvent(
                sample_id=state.samples[-1].sample_id if state.samples else state.episode_id,
                call_id=reply.request_id,
                name=SUBAGENT_TOOL,
                status="infra_error",
                error=reply.error,
                agent_id=agent_id,
            )
        )
        state.count("infra_error")
        state.count("subagent_errors")
        return Outcome(final_text="", finish_reason="infra_error")
    renamed: dict[str, str] = {}
    for sample in reply.samples:
        n = len(state.samples)
        new_id = state.episode_id if n == 0 else f"{state.episode_id}/s{n}"
        renamed[sample.sample_id] = new_id
        branch_of = renamed.get(sample.branch_of, sample.branch_of) if sample.branch_of else ""
        state.samples.append(_builder(sample, new_id, branch_of, tokenizer))
    for event in reply.tool_log:
        state.tool_log.append(
            msgspec.structs.replace(
                event,
                sample_id=renamed.get(event.sample_id, event.sample_id),
                agent_id=event.agent_id or agent_id,
            )
        )
    for name, n in reply.counts.items():
        state.count(name, n)
    return Outcome(final_text=reply.final_text, finish_reason=reply.finish_reason, steps=reply.steps)
