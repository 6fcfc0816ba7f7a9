"""The scorer: one raw episode in, one scored episode out, judged by its environment's verifier.

Environments come from the registry by the episode's `env` name, built once per name with the
configured options and reused. The environment sees the whole episode record
(`Environment.score(task, episode)`: samples, tool log, what a prune hid); an environment that
only grades final text gets it through the base class's adapter, so `score(task, completion)`
keeps working. The verifier never raises (a broken or unparsable answer is a failure score with
`parse_ok=False`). An episode spoiled by an infrastructure failure (`infra_error`) is not judged:
it passes on with reward 0 and the learner drops it, so it is never scored as the model's fault.
What can never be scored, an environment this process does not know, a split that is neither
'train' nor 'heldout', or an episode its environment masks (`Score.unscorable`: a served episode
none of whose feedback the `serve` reward spec uses), raises `Unscorable` so the service
dead-letters it (reason counted) instead of retrying it forever or training on a 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from slipstream.envs import SPLITS, EnvError, Environment, Score, get_env, task_of
from slipstream.schemas import Episode, ScoredEpisode

UnscorableKind = Literal["unknown_env", "bad_split", "masked"]


class Unscorable(Exception):
    """An episode no retry can score; `kind` is the counted reason, the message the detail."""

    def __init__(self, kind: UnscorableKind, detail: str) -> None:
        super().__init__(detail)
        self.kind: UnscorableKind = kind


class Scorer:
    """Scores episodes with the rule-based verifiers of the environment registry."""

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

    def score(self, episode: Episode, *, now: float) -> tuple[ScoredEpisode, Score]:
        """The scored episode (reward = sum of the named components) and the verifier's full Score.

        `episode` must carry its body (load a by-reference stub first); the scored copy keeps the
        episode exactly as given.
        """
        env = self.env(episode.env)
        if episode.split not in SPLITS:
            raise Unscorable(
                "bad_split",
                f"episode {episode.episode_id!r} has split {episode.split!r}; expected one of {SPLITS}",
            )
        # The verifier judges the answer against the reference (the prompt is not kept); the task's
        # metadata travels on the episode (its canonical key rebuilds a coding task's tree).
        task = task_of(episode)
        if episode.infra_error:
            score = Score.of({}, correct=False, parse_ok=True, reason=f"infra_error: {episode.infra_error}")
        else:
            score = env.score(task, episode)
            if score.unscorable:
                # Masked by its environment (a served episode whose feedback the reward spec does
                # not use): never passed on as a 0.
                raise Unscorable("masked", f"episode {episode.episode_id!r}: {score.unscorable}")
        scored = ScoredEpisode(
            episode=episode,
            reward=score.reward,
            components=dict(score.components),
            correct=score.correct,
            scorer_version=env.scorer_version,
            scored_at=now,
        )
        return scored, score
