"""The pinned suite and what one evaluation on it leaves in the object store.

The suite is the held-out split of each configured environment, drawn once with a fixed seed
(`env.generate("heldout", suite_size, seed)` is a pure function of its arguments), so every
version is scored on exactly the same tasks and two versions' per-task scores can be paired.
Its `fingerprint` covers everything that makes two evaluations comparable: the tasks, the
scorer versions, the metric, the sampling and the context restarts (`[summary]`, the run's
`[rollout.summary]`: a summary-chain env is evaluated with the settings it was trained with).
A promoted version's stored details are reused as the baseline only when their fingerprint
matches; otherwise the baseline is evaluated again.

Details live at `evals/<run_id>/v<version:08d>/<suite>.json` (zero-padded like weight versions,
so listings sort): one `TaskScore` per task, in suite order, plus per-environment summaries and,
once decided, the decision.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from slipstream.engine.interface import SamplingParams
from slipstream.envs import Environment, TaskSpec, get_env
from slipstream.eval_gate.config import GateSection
from slipstream.harness import SummaryConfig, greedy_params


def details_key(run_id: str, version: int, suite: str) -> str:
    """Object-store key of one version's per-task details."""
    return f"evals/{run_id}/v{version:08d}/{suite}.json"


class TaskScore(msgspec.Struct, kw_only=True):
    """One task of the suite under one version: its score and the samples behind it."""

    task_id: str
    env: str
    score: float  # mean over samples of the configured metric
    rewards: list[float]
    correct: list[bool]
    completions: list[str]


class EnvSummary(msgspec.Struct, kw_only=True):
    tasks: int
    samples: int
    accuracy: float
    mean_reward: float
    parse_failures: int
    scorer_version: str
    restarts_per_episode: float = 0.0  # context restarts (summaries or truncations) per episode ([summary])


class EvalDetails(msgspec.Struct, kw_only=True):
    """Everything one evaluation measured; `tasks` is in suite order (the pairing order)."""

    run_id: str
    policy_version: int
    suite: str
    fingerprint: str
    metric: str
    score: float
    tasks: list[TaskScore]
    envs: dict[str, EnvSummary]
    seconds: float = 0.0
    evaluated_at: float = 0.0
    manifest_key: str = ""
    # Filled once the gate decided (absent for a baseline evaluated only to compare with).
    decision: str = ""
    reason: str = ""
    baseline_version: int | None = None

    @property
    def scores(self) -> list[float]:
        return [t.score for t in self.tasks]


def encode_details(details: EvalDetails) -> bytes:
    return msgspec.json.encode(details)


def decode_details(data: bytes) -> EvalDetails:
    return msgspec.json.decode(data, type=EvalDetails)


class Suite:
    """The held-out tasks of every configured environment, fixed for the gate's lifetime."""

    def __init__(self, gate: GateSection, summary: SummaryConfig | None = None) -> None:
        self.name = gate.suite
        self.report_only = frozenset(gate.report_only)
        self.summary = summary if summary is not None else SummaryConfig()
        self.metric = gate.metric
        self.samples_per_task = gate.samples_per_task
        self.envs: dict[str, Environment[Any]] = {
            name: get_env(name, **gate.env_options.get(name, {})) for name in gate.envs
        }
        self.tasks: dict[str, list[TaskSpec]] = {
            name: env.generate("heldout", gate.size_of(name), gate.seed) for name, env in self.envs.items()
        }
        self.params: dict[str, SamplingParams] = {name: _params(env, gate) for name, env in self.envs.items()}
        self.fingerprint = self._fingerprint(gate)

    @property
    def size(self) -> int:
        return sum(len(t) for t in self.tasks.values())

    @property
    def task_ids(self) -> list[str]:
        """The tasks a decision pairs (report-only envs left out), in suite order."""
        return [t.task_id for name, tasks in self.tasks.items() if name not in self.report_only for t in tasks]

    def _fingerprint(self, gate: GateSection) -> str:
        h = hashlib.sha256()
        spec: dict[str, object] = {
            "metric": gate.metric,
            "samples_per_task": gate.samples_per_task,
            "params": {name: msgspec.to_builtins(p) for name, p in self.params.items()},
            "scorers": {name: env.scorer_version for name, env in self.envs.items()},
        }
        if self.report_only:
            spec["report_only"] = sorted(self.report_only)
        if self.summary.enabled:
            # Only when on: a gate without summaries keeps the fingerprints it always had.
            spec["summary"] = msgspec.to_builtins(self.summary)
        h.update(msgspec.json.encode(spec))
        for tasks in self.tasks.values():
            for t in tasks:
                h.update(msgspec.json.encode([t.task_id, t.prompt, t.reference]))
        return h.hexdigest()[:16]

    def comparable(self, details: EvalDetails) -> bool:
        """True if `details` were measured on this suite the same way (so they pair task by task)."""
        return details.fingerprint == self.fingerprint and [t.task_id for t in details.tasks] == self.task_ids


def _params(env: Environment[Any], gate: GateSection) -> SamplingParams:
    """Greedy by default, bounded and stopped like the env's answers; seeded so sampling is fixed too."""
    base = greedy_params(env)
    return SamplingParams(
        temperature=gate.temperature,
        max_tokens=gate.max_tokens or base.max_tokens,
        stop=list(base.stop),
        seed=gate.seed,
    )
