"""The episode recorder: the harness side of `EpisodeContext`, turning an env's loop into an `Episode`.

An environment plays its episode through this object (libs/envs/context.py); the recorder owns
every token id. Ids come from exactly two places: the engine (`generate`: sampled ids with their
behaviour log-probs and policy versions, loss mask 1) and the tokenizer applied to text the
environment supplies (`open`, `observe`, `branch`: loss mask 0). Nothing is ever re-encoded from
decoded text, so each sample is, token for token, what the engine consumed and produced.

Layout of one sample (one contiguous sequence, as on the wire):

    prompt ids | sampled ids (mask 1) | observation ids (mask 0) | sampled ids | ...

A context edit (`branch`) closes the parent and opens a new sample whose prompt is assembled
from slices of the parent's ids and newly tokenised text; `branch_pos` is the length of the
prefix it shares with the parent. Nested agents (`spawn`) write their samples into the same
episode under their own agent id, role and trainable flag; a frozen agent's calls go to the
frozen engine when one is given (a copy pinned to one version); with a `SubagentTransport`
(`EpisodeRun.subagents`) a frozen agent is played by the pinned pool instead and merged back
(subagents.py). `spawn` returns the child's `Outcome` with `steps` (tool invocations + 1 per
turn without a call) filled in when the child's env left it 0. The samples, tool log and counts
every agent writes live in state.py.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from slipstream.engine.interface import Engine, GenerationRequest, SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import PLAY_REWARD_PREFIX, TaskSpec
from slipstream.envs.context import PURPOSES, ContextFull, Generation, Nested, Outcome, Purpose, Span
from slipstream.harness.state import EpisodeState, SampleBuilder
from slipstream.harness.subagents import SubagentTransport, build_request, child_steps, merge_reply
from slipstream.harness.summary import SummaryConfig
from slipstream.schemas import (
    Episode,
    Timings,
    ToolEvent,
    Turn,
)
from slipstream.toolcalls import LocalTransport, ToolRegistry, ToolTransport

_SEED_SPACE = 2**62


class RolloutError(RuntimeError):
    """A rollout that could not finish."""


class RolloutAborted(RolloutError):
    """The engine aborted a completion (it is stopping); the task should be handed back."""


class TaskRejected(ValueError):
    """A task that can never be rolled out here (wrong env, bad split, prompt too long); says why."""


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The prompt's token ids, with the tokenizer's bos first when it has one."""
    ids = tokenizer.encode(text)
    return ids if tokenizer.bos_id is None else [tokenizer.bos_id, *ids]


def completion_seed(group_id: str, index: int, turn: int = 0) -> int:
    """A stable per-call seed: distinct within a group, reproducible from the group id."""
    digest = hashlib.blake2b(f"{group_id}/{index}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_SPACE


def call_seed(group_id: str, index: int, turn: int, base_seed: int | None) -> int:
    """The seed of engine call `turn` of episode `index`: `base_seed + index` first when given."""
    if base_seed is None:
        return completion_seed(group_id, index, turn)
    if turn == 0:
        return (base_seed + index) % _SEED_SPACE
    return completion_seed(str(base_seed), index, turn)


def sample_of_request(request_id: str) -> str:
    """The sample a request id continues: request ids are the sample id, then '/t<k>' for k > 0."""
    head, sep, tail = request_id.rpartition("/t")
    return head if sep and tail.isdigit() else request_id


@dataclass(frozen=True)
class EpisodeRun:
    """Fixed inputs of one episode: engines, tokenizer, sampling, identity within its group."""

    engine: Engine
    tokenizer: Tokenizer
    params: SamplingParams
    group_id: str
    index: int
    frozen_engine: Engine | None = None
    max_seq_len: int | None = None
    chat: Callable[[TaskSpec, str], list[dict[str, str]]] | None = None
    """The env's `chat_messages`: the turns a chat model sees around a sample's opening text."""
    tools: Callable[[ToolRegistry], ToolTransport] | None = None
    """Where tool calls run (e.g. a tool-service over NATS); None: in this process."""
    summary: SummaryConfig | None = None
    """Self-summarising chains (summary.py); None or disabled: contexts just grow."""
    subagents: SubagentTransport | None = None
    """Where frozen sub-agents (spawn with trainable=False) run: None = in this process, on
    `frozen_engine` (or `engine` when there is none); else the pinned pool (subagents.py)."""
    run_id: str = ""
    """The training run, told to the sub-agent pool."""
    worker_id: str = ""
    """Who plays this episode, told to the sub-agent pool (logs)."""
    purpose: Purpose = "train"
    """Why it is played: "train" (a rollout or a teacher's episode) or "eval" (`EpisodeContext.purpose`)."""

    def __post_init__(self) -> None:
        if self.purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {PURPOSES}, got {self.purpose!r}")


class Recorder:
    """`EpisodeContext` for one agent of one episode (a spawned agent gets its own Recorder)."""

    def __init__(
        self,
        run: EpisodeRun,
        state: EpisodeState,
        task: TaskSpec,
        *,
        agent_id: str = "policy",
        role: str = "policy",
        trainable: bool = True,
        nested: bool = False,
    ) -> None:
        self._run = run
        self._state = state
        self._task = task
        self.agent_id = agent_id
        self.role = role
        self.trainable = trainable
        self.nested = nested
        """A spawned agent: its tool events are stamped with its agent_id."""
        self._turns: list[int] = []
        self._events: list[ToolEvent] = []

    def steps(self) -> int:
        """This agent's steps so far: its tool invocations, plus 1 for each turn without a call."""
        return child_steps(self._turns, self._events)

    @property
    def run(self) -> EpisodeRun:
        """The episode's fixed inputs (engines, tokenizer, sampling, context size)."""
        return self._run

    @property
    def task(self) -> TaskSpec:
        return self._task

    @property
    def purpose(self) -> Purpose:
        return self._run.purpose

    @property
    def state(self) -> EpisodeState:
        return self._state

    # -- samples ----------------------------------------------------------------------------------

    def _new_sample_id(self) -> str:
        n = len(self._state.samples)
        return self._state.episode_id if n == 0 else f"{self._state.episode_id}/s{n}"

    def _check_fits(self, sample_id: str, needed: int) -> None:
        limit = self._run.max_seq_len
        if limit is not None and needed >= limit:
            raise ContextFull(sample_id, needed, limit)

    def open(
        self, prompt: str, *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> SampleBuilder:
        return self._open(self._prompt_ids(prompt), agent_id=agent_id, role=role, trainable=trainable)

    def open_ids(
        self, ids: list[int], *, agent_id: str | None = None, role: str | None = None, trainable: bool | None = None
    ) -> SampleBuilder:
        vocab = getattr(self._run.tokenizer, "vocab_size", None)
        if not ids or (vocab is not None and any(not 0 <= t < vocab for t in ids)):
            raise ValueError(f"open_ids needs a non-empty prompt of ids in [0, {vocab}), got {len(ids)} ids")
        return self._open(list(ids), agent_id=agent_id, role=role, trainable=trainable)

    def _open(self, ids: list[int], *, agent_id: str | None, role: str | None, trainable: bool | None) -> SampleBuilder:
        sample_id = self._new_sample_id()
        try:
            self._check_fits(sample_id, len(ids))
        except ContextFull as exc:
            if not self._state.samples:
                # The episode cannot even start: this task can never run on this engine.
                raise TaskRejected(
                    f"task {self._task.task_id!r}: prompt has {exc.needed} tokens, the engine's max_seq_len "
                    f"{exc.limit} leaves no room to generate"
                ) from None
            raise
        sample = SampleBuilder(
            sample_id=sample_id,
            agent_id=self.agent_id if agent_id is None else agent_id,
            role=self.role if role is None else role,
            trainable=self.trainable if trainable is None else trainable,
            prompt=ids,
            tokenizer=self._run.tokenizer,
        )
        self._state.samples.append(sample)
        return sample

    def _prompt_ids(self, prompt: str) -> list[int]:
        """[bos] + encode(prompt); for a chat model, the env's chat turns through the model's own template
        (ending at the assistant's turn: the template writes its own start markers, so no extra bos)."""
        tokenizer = self._run.tokenizer
        template = getattr(tokenizer, "chat_template", None)
        if template is None:
            return prompt_ids(tokenizer, prompt)
        chat = self._run.chat
        messages = chat(self._task, prompt) if chat is not None else [{"role": "user", "content": prompt}]
        return tokenizer.encode(template.render(messages, add_generation_prompt=True))

    def _own(self, thread: Any) -> SampleBuilder:
        if not isinstance(thread, SampleBuilder) or thread not in self._state.samples:
            raise ValueError(f"{thread!r} is not a sample of episode {self._state.episode_id!r}")
        return thread

    def _open_for_append(self, thread: Any) -> SampleBuilder:
        sample = self._own(thread)
        if sample.closed:
            raise ValueError(
                f"sample {sample.sample_id!r} is closed ({sample.finish_reason}); "
                "a context edit continues in a new sample"
            )
        return sample

    async def generate(
        self, thread: Any, *, max_tokens: int | None = None, stop: list[str] | None = None
    ) -> Generation:
        sample = self._open_for_append(thread)
        state, run = self._state, self._run
        context = sample.ids()
        try:
            self._check_fits(sample.sample_id, len(context))
        except ContextFull:
            sample.finish_reason = "length"
            raise
        params = run.params
        updates: dict[str, Any] = {
            "seed": call_seed(run.group_id, run.index, state.calls, params.seed),
        }
        if max_tokens is not None:
            updates["max_tokens"] = max(1, min(max_tokens, params.max_tokens))
        if stop is not None:
            updates["stop"] = list(stop)
        suffix = f"/t{sample.calls}" if sample.calls else ""
        request = GenerationRequest(
            request_id=f"{sample.sample_id}{suffix}",
            prompt_ids=context,
            params=msgspec.structs.replace(params, **updates),
            # The engine keeps this sample's KV cache between its turns (released when the episode ends).
            session_id=sample.sample_id,
        )
        engine = run.engine if sample.trainable or run.frozen_engine is None else run.frozen_engine
        turn = state.calls
        state.calls += 1
        sample.calls += 1
        self._turns.append(turn)
        result = await engine.generate(request)
        if result.finish_reason == "abort":
            raise RolloutAborted(f"completion {request.request_id} was aborted by the engine")
        if turn == 0:
            state.queued_at, state.started_at = result.timings.queued_at, result.timings.started_at
        state.finished_at = result.timings.finished_at
        state.generate_s += result.timings.generate_s
        start = len(sample)
        sample.after.extend(result.completion_ids)
        sample.logprobs.extend(result.logprobs)
        sample.mask.extend([1] * len(result.completion_ids))
        sample.add_versions(list(result.segments))
        if result.routes_per_token:
            # The engine's routes cover this call's whole context, so the latest call's replace the earlier ones.
            sample.routes, sample.routes_per_token = result.routes, result.routes_per_token
        tok = run.tokenizer
        text = tok.decode([t for t in result.completion_ids if t != tok.eos_id])
        sample.turns.append(Turn(role="policy", start=start, end=len(sample), text=text))
        sample.finish_reason = result.finish_reason
        state.last_finish = result.finish_reason
        state.count("turns")
        return Generation(
            text=text,
            n_tokens=len(result.completion_ids),
            finish_reason=result.finish_reason,
            turn=turn,
            ids=list(result.completion_ids),
            logprobs=list(result.logprobs),
        )

    def observe(self, thread: Any, text: str, *, role: str = "observation") -> None:
        self._append(thread, self._run.tokenizer.encode(text), text, role)

    def observe_ids(self, thread: Any, ids: list[int], *, role: str = "observation") -> None:
        tok = self._run.tokenizer
        vocab = getattr(tok, "vocab_size", None)
        if vocab is not None and any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"observe_ids: ids outside the vocabulary [0, {vocab})")
        self._append(thread, list(ids), tok.decode(list(ids)), role)

    def _append(self, thread: Any, ids: list[int], text: str, role: str) -> None:
        sample = self._open_for_append(thread)
        try:
            self._check_fits(sample.sample_id, len(sample) + len(ids))
        except ContextFull:
            sample.finish_reason = "length"
            raise
        start = len(sample)
        sample.after.extend(ids)
        sample.logprobs.extend([0.0] * len(ids))
        sample.mask.extend([0] * len(ids))
        version = sample.last_version()
        sample.add_versions([(self._run.engine.policy_version if version is None else version, len(ids))])
        sample.turns.append(Turn(role=role, start=start, end=len(sample), text=text, observation=text))

    def branch(self, parent: Any, pieces: list[Span | str], *, edit: str, finish_reason: str = "edit") -> SampleBuilder:
        source = self._own(parent)
        if not edit:
            raise ValueError("branch needs a non-empty edit kind ('prune', 'summary', 'handoff', ...)")
        parent_ids = source.ids()
        ids: list[int] = []
        for piece in pieces:
            if isinstance(piece, Span):
                if piece.end > len(parent_ids):
                    raise ValueError(
                        f"span [{piece.start}, {piece.end}) is past the end of sample {source.sample_id!r} "
                        f"({len(parent_ids)} tokens)"
                    )
                ids.extend(parent_ids[piece.start : piece.end])
            elif isinstance(piece, str):
                ids.extend(self._run.tokenizer.encode(piece))
            else:
                raise TypeError(f"branch pieces are Span or str, got {type(piece).__name__}")
        if not ids:
            raise ValueError(f"branch of {source.sample_id!r} has an empty prompt")
        shared = 0
        while shared < min(len(ids), len(parent_ids)) and ids[shared] == parent_ids[shared]:
            shared += 1
        sample_id = self._new_sample_id()
        self._check_fits(sample_id, len(ids))
        if not source.closed:
            source.closed = True
            source.finish_reason = finish_reason
        sample = SampleBuilder(
            sample_id=sample_id,
            agent_id=source.agent_id,
            role=source.role,
            trainable=source.trainable,
            prompt=ids,
            tokenizer=self._run.tokenizer,
            branch_of=source.sample_id,
            branch_pos=shared,
            edit=edit,
        )
        self._state.samples.append(sample)
        self._state.count(f"edit_{edit}")
        return sample

    # -- nested agents, log, counts -----------------------------------------------------------------

    async def spawn(
        self,
        env: Nested,
        task: TaskSpec,
        *,
        agent_id: str,
        role: str = "subagent",
        trainable: bool = False,
    ) -> Outcome:
        if agent_id == self.agent_id:
            raise ValueError(f"a spawned agent needs its own agent_id, not {agent_id!r}")
        self._state.count("subagents")
        run = self._run
        if not trainable and run.subagents is not None:
            request = build_request(
                env,
                task,
                episode_id=self._state.episode_id,
                agent_id=agent_id,
                role=role,
                params=run.params,
                # Per child, not per turn: children spawned together in one turn get distinct seeds.
                seed=completion_seed(f"{run.params.seed}/{self._state.episode_id}/{agent_id}", 0),
                run_id=run.run_id,
                caller=run.worker_id,
            )
            reply = await run.subagents.run(request)
            return merge_reply(run.tokenizer, self._state, reply, agent_id=agent_id)
        child = Recorder(run, self._state, task, agent_id=agent_id, role=role, trainable=trainable, nested=True)
        outcome = await env.run(child)
        if isinstance(outcome, Outcome) and outcome.steps == 0:
            outcome = msgspec.structs.replace(outcome, steps=child.steps())
        return outcome

    def tools(self, registry: ToolRegistry) -> ToolTransport:
        factory = self._run.tools
        return LocalTransport(registry) if factory is None else factory(registry)

    def log_tool(self, event: ToolEvent) -> None:
        if self.nested and not event.agent_id:
            event = msgspec.structs.replace(event, agent_id=self.agent_id)
        self._events.append(event)
        self._state.tool_log.append(event)
        self._state.count("tool_calls")
        if event.status != "ok":
            self._state.count(event.status)

    def count(self, name: str, n: int = 1) -> None:
        self._state.count(name, n)

    def reward(self, name: str, value: float) -> None:
        self._state.rewards[name] = self._state.rewards.get(name, 0.0) + float(value)


def assemble(
    state: EpisodeState,
    task: TaskSpec,
    outcome: Outcome,
    *,
    group_id: str,
    index: int,
    group_size: int,
    run_id: str,
    worker_id: str,
) -> Episode:
    """The wire `Episode` of a finished episode."""
    metadata = dict(task.metadata)
    metadata.update({f"{PLAY_REWARD_PREFIX}{k}": repr(v) for k, v in state.rewards.items()})
    counts = dict(state.counts)
    counts["samples"] = len(state.samples)
    infra = [e for e in state.tool_log if e.status == "infra_error"]
    return Episode(
        episode_id=state.episode_id,
        task_id=task.task_id,
        env=task.env,
        run_id=run_id,
        group_id=group_id,
        group_index=index,
        group_size=group_size,
        split=task.split,
        reference=task.reference,
        samples=[s.to_sample() for s in state.samples],
        tool_log=list(state.tool_log),
        final_text=outcome.final_text,
        finish_reason=outcome.finish_reason or state.last_finish,
        worker_id=worker_id,
        timings=Timings(
            queued_at=state.queued_at,
            started_at=state.started_at,
            finished_at=state.finished_at or time.time(),
            generate_s=state.generate_s,
        ),
        metadata=metadata,
        counts=counts,
        infra_error=f"{infra[0].name}: {infra[0].error}" if infra else "",
    )
