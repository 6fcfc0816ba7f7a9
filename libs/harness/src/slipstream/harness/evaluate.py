"""Held-out evaluation: roll tasks out with the training harness and score them with the env's verifier.

eval-gate uses it to decide whether a weight version is promoted, and `slipstream demo` to show
held-out accuracy before and after RL. It runs the same `rollout_episodes` as training, so what
is measured is what was trained; only the sampling differs (greedy by default). Each episode is
scored whole (`env.score(task, episode)`), and tool calls and invalid calls are summed.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Annotated

import msgspec

from slipstream.engine.interface import Engine, SamplingParams
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs.base import Environment, TaskSpec
from slipstream.harness.rollout import as_spec, rollout_episodes
from slipstream.harness.summary import SummaryConfig
from slipstream.schemas import Episode, Task

Doc = msgspec.Meta


class TaskEval(msgspec.Struct, kw_only=True):
    """One task's samples and their scores."""

    task_id: str
    prompt: str
    reference: str
    completions: list[str]
    rewards: list[float]
    correct: list[bool]
    parse_ok: list[bool]
    tool_calls: list[int] = []
    invalid_calls: list[int] = []
    tokens: Annotated[list[int], Doc(description="Per episode: tokens over all its samples (every link).")] = []
    sampled_tokens: Annotated[list[int], Doc(description="Per episode: tokens the policy sampled.")] = []
    restarts: Annotated[list[int], Doc(description="Per episode: summary or truncation restarts.")] = []

    @property
    def accuracy(self) -> float:
        return sum(self.correct) / len(self.correct) if self.correct else 0.0


class EvalReport(msgspec.Struct, kw_only=True):
    """What `evaluate` measured; `accuracy` and `mean_reward` are over every scored sample."""

    env: str
    scorer_version: str
    n_tasks: int
    samples_per_task: int
    n: int
    accuracy: float
    mean_reward: float
    parse_failures: int
    policy_versions: list[int]
    seconds: float
    frozen_versions: Annotated[
        list[int], Doc(description="Versions that produced the frozen (non-trainable) agents' tokens: sub-agents.")
    ] = []
    tasks: list[TaskEval]
    tool_calls: Annotated[int, Doc(description="Tool calls over every episode.")] = 0
    invalid_calls: Annotated[int, Doc(description="Of those, calls tagged invalid_tool_call.")] = 0
    metrics: Annotated[
        dict[str, float], Doc(description="The env's own figures over every episode (`Environment.eval_metrics`).")
    ] = {}
    tokens: Annotated[int, Doc(description="Tokens over every sample of every episode (each link counted).")] = 0
    sampled_tokens: Annotated[int, Doc(description="Of those, tokens the policy sampled.")] = 0
    restarts: Annotated[int, Doc(description="Context restarts (summaries or truncations) over every episode.")] = 0

    @property
    def invalid_call_rate(self) -> float:
        """Invalid calls per tool call (0.0 when no call was made)."""
        return self.invalid_calls / self.tool_calls if self.tool_calls else 0.0


def greedy_params(env: Environment[msgspec.Struct]) -> SamplingParams:
    """Argmax decoding, bounded by the env's longest sensible answer and stopped at its terminator.

    `max_tokens` counts one token per character (exact for byte tokenizers, an upper bound for
    BPE on ASCII) plus one for eos.
    """
    # An env whose own loop decides when a turn ends (`verifiers`: its harness) has no terminator.
    stop = [env.terminator] if env.terminator else []
    return SamplingParams(temperature=0.0, max_tokens=env.max_completion_chars + 1, stop=stop)


async def evaluate(
    engine: Engine,
    tokenizer: Tokenizer,
    env: Environment[msgspec.Struct],
    tasks: Sequence[TaskSpec | Task],
    *,
    samples_per_task: int = 1,
    params: SamplingParams | None = None,
    concurrency: int = 16,
    summary: SummaryConfig | None = None,
    frozen_engine: Engine | None = None,
) -> EvalReport:
    """Roll out every task `samples_per_task` times (greedy unless `params`) and score each sample.

    At most `concurrency` tasks are in the engine at once. The report lists every policy version
    that produced a scored token (more than one if weights changed during the evaluation).
    `summary` restarts long contexts as training does (a summary, or the truncation baseline).
    `frozen_engine` plays the frozen (non-trainable) agents, as in training: e.g. the swarm's
    sub-agents on the warm-start weights while `engine` holds the version under evaluation.
    Without one they play on `engine`, the version under evaluation: callers that evaluate a
    version other than the sub-agents' pin must pass it. `frozen_versions` lists what they ran on.
    """
    if not tasks:
        raise ValueError("evaluate needs at least one task")
    if samples_per_task < 1:
        raise ValueError(f"samples_per_task must be >= 1, got {samples_per_task}")
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    sampling = params if params is not None else greedy_params(env)
    if summary is not None and summary.enabled and (summary.mode == "summary" or summary.policy):
        # A turn's max_tokens is capped by the params': leave a summary its whole budget.
        sampling = msgspec.structs.replace(sampling, max_tokens=max(sampling.max_tokens, summary.summary_tokens))
    specs = [as_spec(t) for t in tasks]
    # Request ids must not collide with other users of the same engine (a worker's rollouts).
    run = f"eval-{uuid.uuid4().hex[:8]}"
    slots = asyncio.Semaphore(concurrency)
    versions: set[int] = set()
    frozen: set[int] = set()
    played: list[tuple[int, int, TaskSpec, Episode]] = []
    t0 = time.perf_counter()

    async def one(i: int, spec: TaskSpec) -> TaskEval:
        async with slots:
            episodes = await rollout_episodes(
                engine,
                tokenizer,
                env,
                spec,
                group_size=samples_per_task,
                params=sampling,
                worker_id="eval",
                group_id=f"{run}/{i}",
                summary=summary,
                frozen_engine=frozen_engine,
                purpose="eval",
            )
        scores = [env.score(spec, e) for e in episodes]
        played.extend((i, j, spec, e) for j, e in enumerate(episodes))
        for e in episodes:
            versions.update(seg.policy_version for s in e.samples if s.trainable for seg in s.segments)
            frozen.update(seg.policy_version for s in e.samples if not s.trainable for seg in s.segments)
        return TaskEval(
            task_id=spec.task_id,
            prompt=spec.prompt,
            reference=spec.reference,
            completions=[e.final_text for e in episodes],
            rewards=[s.reward for s in scores],
            correct=[s.correct for s in scores],
            parse_ok=[s.parse_ok for s in scores],
            tool_calls=[e.counts.get("tool_calls", 0) for e in episodes],
            invalid_calls=[e.counts.get("invalid_tool_call", 0) for e in episodes],
            tokens=[sum(len(s.ids()) for s in e.samples) for e in episodes],
            sampled_tokens=[sum(sum(s.mask()) for s in e.samples) for e in episodes],
            restarts=[e.counts.get("summaries", 0) + e.counts.get("truncations", 0) for e in episodes],
        )

    results = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
    n = sum(len(r.correct) for r in results)
    played.sort(key=lambda row: (row[0], row[1]))
    metrics = env.eval_metrics([row[2] for row in played], [row[3] for row in played])
    return EvalReport(
        env=env.name,
        scorer_version=env.scorer_version,
        n_tasks=len(results),
        samples_per_task=samples_per_task,
        n=n,
        accuracy=sum(sum(r.correct) for r in results) / n,
        mean_reward=sum(sum(r.rewards) for r in results) / n,
        parse_failures=sum(r.parse_ok.count(False) for r in results),
        policy_versions=sorted(versions),
        frozen_versions=sorted(frozen),
        seconds=time.perf_counter() - t0,
        tasks=list(results),
        tool_calls=sum(sum(r.tool_calls) for r in results),
        invalid_calls=sum(sum(r.invalid_calls) for r in results),
        metrics=metrics,
        tokens=sum(sum(r.tokens) for r in results),
        sampled_tokens=sum(sum(r.sampled_tokens) for r in results),
        restarts=sum(sum(r.restarts) for r in results),
    )
