"""The rollout: one task played `group_size` times against an environment, as `Trajectory`s.

"Train where you deploy": the rollout worker, eval-gate and serving all run this one loop, so a
policy is trained on exactly the token sequences it will see in use.

One completion follows the environment's episode contract (libs/envs/base.py):

    reset(task) -> prompt text -> [bos] + encode(prompt)
    loop: generate -> policy tokens (loss mask 1, behaviour log-probs, the engine's versions)
          env.step(output) -> done? stop : observation tokens appended (mask 0, log-prob 0)

A single-turn environment is done after one step. The trajectory's per-token arrays cover the
completion (everything after the prompt): observation tokens carry the version of the policy
token before them, so they never make a trajectory look staler than what the policy sampled.
The `group_size` completions run concurrently in the engine, each with its own seed.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from dataclasses import dataclass, field

import msgspec

from slipstream.engine.interface import Engine, GenerationRequest, SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import Environment, TaskSpec
from slipstream.schemas import PolicySegment, Task, Timings, Trajectory, Turn, pack_floats, pack_ids, pack_mask

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
    """A stable per-completion seed: distinct within a group, reproducible from the group id."""
    digest = hashlib.blake2b(f"{group_id}/{index}/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % _SEED_SPACE


def _seed(group_id: str, index: int, turn: int, base_seed: int | None) -> int:
    if base_seed is None:
        return completion_seed(group_id, index, turn)
    if turn == 0:
        return (base_seed + index) % _SEED_SPACE
    return completion_seed(str(base_seed), index, turn)


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


@dataclass
class _Play:
    """One completion being assembled (completion-aligned arrays, as on the wire)."""

    prompt: list[int]
    completion: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    segments: list[list[int]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    finish_reason: str = ""
    queued_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    generate_s: float = 0.0

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.completion)

    def add_versions(self, runs: list[tuple[int, int]]) -> None:
        for version, n in runs:
            if n <= 0:
                continue
            if self.segments and self.segments[-1][0] == version:
                self.segments[-1][1] += n
            else:
                self.segments.append([version, n])


async def _play(
    engine: Engine,
    tokenizer: Tokenizer,
    env: Environment[msgspec.Struct],
    spec: TaskSpec,
    index: int,
    *,
    params: SamplingParams,
    group_id: str,
    base_seed: int | None,
    max_seq_len: int | None,
) -> _Play:
    episode = env.reset(spec)
    play = _Play(prompt=prompt_ids(tokenizer, episode.observation))
    if max_seq_len is not None and len(play.prompt) >= max_seq_len:
        raise TaskRejected(
            f"task {spec.task_id!r}: prompt has {len(play.prompt)} tokens, the engine's max_seq_len "
            f"{max_seq_len} leaves no room to generate"
        )
    turn = 0
    while True:
        suffix = f"/t{turn}" if turn else ""
        request = GenerationRequest(
            request_id=f"{group_id}/{index}{suffix}",
            prompt_ids=[*play.prompt, *play.completion],
            params=msgspec.structs.replace(params, seed=_seed(group_id, index, turn, base_seed)),
        )
        result = await engine.generate(request)
        if result.finish_reason == "abort":
            raise RolloutAborted(f"completion {request.request_id} was aborted by the engine")
        if turn == 0:
            play.queued_at, play.started_at = result.timings.queued_at, result.timings.started_at
        play.finished_at = result.timings.finished_at
        play.generate_s += result.timings.generate_s
        start = play.length
        play.completion.extend(result.completion_ids)
        play.logprobs.extend(result.logprobs)
        play.mask.extend([1] * len(result.completion_ids))
        play.add_versions(list(result.segments))
        text = tokenizer.decode([t for t in result.completion_ids if t != tokenizer.eos_id])
        play.turns.append(Turn(role="policy", start=start, end=play.length, text=text))
        play.finish_reason = result.finish_reason
        step = env.step(episode, text)
        if step.done:
            play.finish_reason = step.info.get("truncated", play.finish_reason)
            return play
        observation = step.observation or ""
        obs_ids = tokenizer.encode(observation)
        if max_seq_len is not None and play.length + len(obs_ids) >= max_seq_len:
            # The next turn cannot fit: the episode ends here, as a generation that hit its length.
            play.finish_reason = "length"
            return play
        start = play.length
        play.completion.extend(obs_ids)
        play.logprobs.extend([0.0] * len(obs_ids))
        play.mask.extend([0] * len(obs_ids))
        last_version = play.segments[-1][0] if play.segments else engine.policy_version
        play.add_versions([(last_version, len(obs_ids))])
        play.turns.append(
            Turn(role="observation", start=start, end=play.length, text=observation, observation=observation)
        )
        turn += 1


def _trajectory(
    play: _Play,
    tokenizer: Tokenizer,
    spec: TaskSpec,
    index: int,
    *,
    group_id: str,
    group_size: int,
    run_id: str,
    worker_id: str,
) -> Trajectory:
    completion_text = tokenizer.decode([t for t in play.completion if t != tokenizer.eos_id])
    return Trajectory(
        trajectory_id=f"{group_id}/{index}",
        task_id=spec.task_id,
        env=spec.env,
        run_id=run_id,
        group_index=index,
        group_size=group_size,
        prompt_len=len(play.prompt),
        token_ids=pack_ids([*play.prompt, *play.completion]),
        logprobs=pack_floats(play.logprobs),
        loss_mask=pack_mask(play.mask),
        segments=[PolicySegment(v, n) for v, n in play.segments],
        turns=play.turns,
        completion_text=completion_text,
        finish_reason=play.finish_reason,
        worker_id=worker_id,
        timings=Timings(
            queued_at=play.queued_at,
            started_at=play.started_at,
            finished_at=play.finished_at,
            generate_s=play.generate_s,
        ),
        metadata=dict(spec.metadata),
        group_id=group_id,
        split=spec.split,
        reference=spec.reference,
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
    """Sample `task` `group_size` times (default: the wire task's group_size, else 1).

    Returns one Trajectory per completion, in index order, with trajectory_id
    f"{group_id}/{index}". `group_id` defaults to a fresh f"{task_id}/<uuid>"; `run_id` to the
    wire task's. Seeds: `params.seed + index` when params carry a seed, else derived from the
    group id. Raises TaskRejected for a task this env/engine can never run, RolloutAborted when
    the engine aborts a completion; on any failure the other completions are cancelled.
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
    jobs = [
        asyncio.create_task(
            _play(
                engine,
                tokenizer,
                env,
                spec,
                i,
                params=params,
                group_id=gid,
                base_seed=params.seed,
                max_seq_len=max_seq_len if isinstance(max_seq_len, int) else None,
            ),
            name=f"rollout {gid}/{i}",
        )
        for i in range(size)
    ]
    try:
        plays = await asyncio.gather(*jobs)
    except BaseException:
        # One failed (or we were cancelled): the siblings' engine requests are aborted, not orphaned.
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        raise
    return [
        _trajectory(play, tokenizer, spec, i, group_id=gid, group_size=size, run_id=run_id, worker_id=worker_id)
        for i, play in enumerate(plays)
    ]
