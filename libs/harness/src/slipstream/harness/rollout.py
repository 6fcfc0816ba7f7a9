"""The rollout: one task played `group_size` times against an environment, as `Episode`s.

"Train where you deploy": the rollout worker, eval-gate and serving all run this one loop, so a
policy is trained on exactly the token sequences it will see in use.

Each episode is the environment's own loop, `env.run(ctx)`, played through a `Recorder`
(episode.py) that owns every token id: sampled ids from the engine, observation ids from the
tokenizer. Environments written against `reset`/`step` run through the adapter in
`Environment.run`: one sample,

    reset(task) -> prompt text -> [bos] + encode(prompt)
    loop: generate -> policy tokens (loss mask 1, behaviour log-probs, the engine's versions)
          env.step(output) -> done? stop : observation tokens appended (mask 0, log-prob 0)

Observation tokens carry the version of the policy token before them, so they never make a
sample look staler than what the policy sampled. The `group_size` episodes run concurrently in
the engine, each engine call with its own seed. `rollout_group` is the single-sample view of the
same thing, as v1 `Trajectory`s.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable

import msgspec

from slipstream.engine.interface import Engine, SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import Environment, TaskSpec
from slipstream.envs.context import ContextFull, EpisodeContext, Outcome, Purpose
from slipstream.harness.episode import (
    EpisodeRun,
    Recorder,
    RolloutAborted,
    RolloutError,
    TaskRejected,
    assemble,
    completion_seed,
    prompt_ids,
)
from slipstream.harness.state import EpisodeState
from slipstream.harness.subagents import SubagentTransport
from slipstream.harness.summarising import SummarisingContext
from slipstream.harness.summary import SummaryConfig, group_threshold
from slipstream.schemas import Episode, Task, Trajectory
from slipstream.toolcalls import ToolRegistry, ToolTransport

__all__ = [
    "RolloutAborted",
    "RolloutError",
    "TaskRejected",
    "as_spec",
    "completion_seed",
    "new_group_id",
    "play_episode",
    "prompt_ids",
    "rollout_episodes",
    "rollout_group",
    "trajectory_of",
]


def new_group_id(task_id: str) -> str:
    """A fresh id for one sampling of a task (a redelivered task forms a new group)."""
    return f"{task_id}/{uuid.uuid4().hex[:12]}"


def as_spec(task: TaskSpec | Task) -> TaskSpec:
    """The environment's view of a task; a wire `Task` with a bad split is rejected."""
    if isinstance(task, TaskSpec):
        return task
    try:
        return TaskSpec.from_task(task)
    except ValueError as exc:
        raise TaskRejected(str(exc)) from exc


async def play_episode(
    env: Environment[msgspec.Struct], spec: TaskSpec, run: EpisodeRun
) -> tuple[EpisodeState, Outcome]:
    """Play one episode; a sample outgrowing the engine's context ends it with finish_reason 'length'."""
    state = EpisodeState(episode_id=f"{run.group_id}/{run.index}")
    recorder = Recorder(run, state, spec)
    ctx: EpisodeContext = recorder
    if run.summary is not None and run.summary.enabled:
        ctx = SummarisingContext(recorder, run.summary, group_threshold(run.summary, run.group_id))
    try:
        outcome = await env.run(ctx)
    except ContextFull:
        root = state.samples[0] if state.samples else None
        outcome = Outcome(final_text=root.completion_text() if root is not None else "", finish_reason="length")
    finally:
        _release_sessions(run, state)
    if not isinstance(outcome, Outcome):
        raise RolloutError(f"{env.name}.run returned {type(outcome).__name__}, not an Outcome")
    if not state.samples:
        raise RolloutError(f"{env.name}.run on task {spec.task_id!r} finished without opening a sample")
    return state, outcome


def _release_sessions(run: EpisodeRun, state: EpisodeState) -> None:
    """Let the engines drop the KV caches they kept for this episode's samples."""
    for engine in {id(e): e for e in (run.engine, run.frozen_engine) if e is not None}.values():
        release = getattr(engine, "release", None)
        if release is not None:
            for sample in state.samples:
                release(sample.sample_id)


async def rollout_episodes(
    engine: Engine,
    tokenizer: Tokenizer,
    env: Environment[msgspec.Struct],
    task: TaskSpec | Task,
    *,
    group_size: int | None = None,
    params: SamplingParams,
    worker_id: str = "",
    run_id: str | None = None,
    group_id: str | None = None,
    frozen_engine: Engine | None = None,
    tools: Callable[[ToolRegistry], ToolTransport] | None = None,
    summary: SummaryConfig | None = None,
    subagents: SubagentTransport | None = None,
    purpose: Purpose = "train",
) -> list[Episode]:
    """Play `task` `group_size` times (default: the wire task's group_size, else 1), concurrently.

    Returns one Episode per attempt, in index order, with episode_id f"{group_id}/{index}" (its
    root sample has the same id). `group_id` defaults to a fresh f"{task_id}/<uuid>"; `run_id` to
    the wire task's. Seeds: engine call k of episode i uses `params.seed + i` for k = 0 when
    params carry a seed, else a hash of (group id, i, k). `frozen_engine` serves the calls of
    frozen (non-trainable) agents; `tools` says where tool calls run (None: in this process);
    `summary` makes long contexts summarise and restart (summary.py; one threshold per group);
    `subagents` plays frozen spawned agents in the pinned pool instead (subagents.py); `purpose`
    is what the episodes are played for ("train": a training rollout or a teacher's episode;
    "eval": an evaluation), which the environment reads from its context (`EpisodeContext.purpose`).
    Raises TaskRejected for a task this env/engine can never run, RolloutAborted when the engine
    aborts a call; on any failure the other episodes are cancelled.
    """
    spec = as_spec(task)
    if spec.env != env.name:
        raise TaskRejected(f"task {spec.task_id!r} is for env {spec.env!r}, not {env.name!r}")
    size = group_size if group_size is not None else (task.group_size if isinstance(task, Task) else 1)
    if size < 1:
        raise TaskRejected(f"task {spec.task_id!r}: group_size must be >= 1, got {size}")
    if run_id is None:
        run_id = task.run_id if isinstance(task, Task) else ""
    gid = group_id or new_group_id(spec.task_id)
    max_seq_len = getattr(engine, "max_seq_len", None)
    runs = [
        EpisodeRun(
            engine=engine,
            tokenizer=tokenizer,
            params=params,
            group_id=gid,
            index=i,
            frozen_engine=frozen_engine,
            max_seq_len=max_seq_len if isinstance(max_seq_len, int) else None,
            chat=env.chat_messages,
            tools=tools,
            summary=summary,
            subagents=subagents,
            run_id=run_id,
            worker_id=worker_id,
            purpose=purpose,
        )
        for i in range(size)
    ]
    jobs = [asyncio.create_task(play_episode(env, spec, run), name=f"rollout {gid}/{run.index}") for run in runs]
    try:
        played = await asyncio.gather(*jobs)
    except BaseException:
        # One failed (or we were cancelled): the siblings' engine requests are aborted, not orphaned.
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise
    return [
        assemble(state, spec, outcome, group_id=gid, index=i, group_size=size, run_id=run_id, worker_id=worker_id)
        for i, (state, outcome) in enumerate(played)
    ]


def trajectory_of(episode: Episode) -> Trajectory:
    """The v1 `Trajectory` of a one-sample episode (ValueError for an episode of several samples)."""
    if len(episode.samples) != 1:
        raise ValueError(
            f"episode {episode.episode_id!r} has {len(episode.samples)} samples; only a one-sample episode "
            "is a Trajectory"
        )
    sample = episode.samples[0]
    return Trajectory(
        trajectory_id=episode.episode_id,
        task_id=episode.task_id,
        env=episode.env,
        run_id=episode.run_id,
        group_index=episode.group_index,
        group_size=episode.group_size,
        prompt_len=sample.prompt_len,
        token_ids=sample.token_ids,
        logprobs=sample.logprobs,
        loss_mask=sample.loss_mask,
        segments=list(sample.segments),
        turns=list(sample.turns),
        completion_text=episode.final_text,
        finish_reason=episode.finish_reason,
        worker_id=episode.worker_id,
        timings=episode.timings,
        metadata=dict(episode.metadata),
        group_id=episode.group_id,
        split=episode.split,
        reference=episode.reference,
    )


async def rollout_group(
    engine: Engine,
    tokenizer: Tokenizer,
    env: Environment[msgspec.Struct],
    task: TaskSpec | Task,
    *,
    group_size: int | None = None,
    params: SamplingParams,
    worker_id: str = "",
    run_id: str | None = None,
    group_id: str | None = None,
) -> list[Trajectory]:
    """`rollout_episodes` for one-sample environments, as v1 Trajectories (trajectory_id = episode_id).

    An environment whose episodes edit their context or spawn agents has several samples per
    episode and must go through `rollout_episodes`; here it raises ValueError.
    """
    episodes = await rollout_episodes(
        engine,
        tokenizer,
        env,
        task,
        group_size=group_size,
        params=params,
        worker_id=worker_id,
        run_id=run_id,
        group_id=group_id,
    )
    return [trajectory_of(e) for e in episodes]
