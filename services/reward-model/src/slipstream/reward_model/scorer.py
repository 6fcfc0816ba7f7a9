"""The scorer: one raw trajectory in, one scored trajectory out, judged by its environment's verifier.

Environments come from the registry by the trajectory's `env` name, built once per name with the
configured options and reused. The verifier never raises (a broken or unparsable answer is a
failure score with `parse_ok=False`); what can never be scored, an environment this process does
not know or a split that is neither 'train' nor 'heldout', raises `Unscorable` so the service
dead-letters it instead of retrying it forever.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, cast

from slipstream.envs import SPLITS, EnvError, Environment, Score, Split, TaskSpec, get_env
from slipstream.schemas import ScoredTrajectory, Trajectory

UnscorableKind = Literal["unknown_env", "bad_split"]


class Unscorable(Exception):
    """A trajectory no retry can score; `kind` is the counted reason, the message the detail."""

    def __init__(self, kind: UnscorableKind, detail: str) -> None:
        super().__init__(detail)
        self.kind: UnscorableKind = kind


class Scorer:
    """Scores trajectories with the rule-based verifiers of the environment registry."""

    def __init__(self, env_options: Mapping[str, Mapping[str, Any]] | None = None) -> None:
        self._options = {name: dict(opts) for name, opts in (env_options or {}).items()}
        self._envs: dict[str, Environment[Any]] = {}
        # Configured options are checked now: a bad option is a config error at start, not a
        # dead letter per message.
        for name, opts in self._options.items():
            self._envs[name] = get_env(name, **opts)

    def env(self, name: str) -> Environment[Any]:
        """The environment `name` with its configured options; `Unscorable` if it is not registered."""
        found = self._envs.get(name)
        if found is None:
            try:
                found = get_env(name)
            except EnvError as exc:
                raise Unscorable("unknown_env", str(exc)) from None
            self._envs[name] = found
        return found

    def score(self, traj: Trajectory, *, now: float) -> tuple[ScoredTrajectory, Score]:
        """The scored trajectory (reward = sum of the named components) and the verifier's full Score."""
        env = self.env(traj.env)
        if traj.split not in SPLITS:
            raise Unscorable(
                "bad_split", f"trajectory {traj.trajectory_id!r} has split {traj.split!r}; expected one of {SPLITS}"
            )
        task = TaskSpec(
            task_id=traj.task_id,
            env=traj.env,
            prompt="",  # the verifier judges the answer against the reference; the prompt is not needed
            reference=traj.reference,
            seed=0,
            split=cast(Split, traj.split),
        )
        score = env.score(task, traj.completion_text)
        scored = ScoredTrajectory(
            trajectory=traj,
            reward=score.reward,
            components=dict(score.components),
            correct=score.correct,
            scorer_version=env.scorer_version,
            scored_at=now,
        )
        return scored, score
