"""The rubric judges of `[reward.judges]`, and how a judge's verdict joins a verifier's score.

Each configured judge scores the episodes of its `envs` (one judge per env). The verifier runs
first (in a thread); then the judge's calls run on the service's event loop as plain network
I/O, so a slow judge holds only the episodes it is judging: the other deliveries, heartbeats
and probes go on, and the judge's own limits (concurrency, rate, timeout) bound its endpoint.

A usable verdict adds the component `judge` = weight x aggregate to the verifier's and records
the `Judgement` (model, rubric set version, rubric ids, per-rubric scores). An unscorable
verdict leaves the reward as the verifier made it, records the judgement and sets
`ScoredEpisode.unscorable` with the reason, so the learner drops it (reason `unscorable`) and
forms its group's baseline from the others, instead of training on a made-up score.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import msgspec

from slipstream.control.client import ControlClient
from slipstream.judge.cache import VerdictCache
from slipstream.judge.config import JudgeConfig
from slipstream.judge.judge import Judge
from slipstream.judge.verdict import JudgeInput
from slipstream.schemas import Episode, Judgement, ScoredEpisode

COMPONENT = "judge"
"""Name of the reward component a judge adds."""


def with_judgement(scored: ScoredEpisode, judgement: Judgement, weight: float) -> ScoredEpisode:
    """`scored` with the judge's verdict joined: a weighted `judge` component, or marked unscorable."""
    judgements = [*scored.judgements, judgement]
    if judgement.unscorable:
        return msgspec.structs.replace(scored, unscorable=judgement.unscorable, judgements=judgements)
    if COMPONENT in scored.components:
        raise ValueError(f"episode already has a {COMPONENT!r} component: {sorted(scored.components)}")
    value = weight * judgement.aggregate
    return msgspec.structs.replace(
        scored,
        reward=scored.reward + value,
        components={**scored.components, COMPONENT: value},
        judgements=judgements,
        scorer_version=f"{scored.scorer_version}+{judgement.judge}:{judgement.model}:{judgement.rubric_set}",
    )


class Judges:
    """The configured judges, by the env they score; one Redis client shared by their caches."""

    def __init__(self, judges: Mapping[str, Judge], cache_client: ControlClient | None = None) -> None:
        self.judges = dict(judges)
        self._by_env = {env: j for j in self.judges.values() for env in j.cfg.envs}
        self._cache_client = cache_client

    @classmethod
    def from_config(cls, configs: Mapping[str, JudgeConfig], *, redis_url: str) -> Judges:
        """Every judge built and checked (rubric files loaded, API keys resolved): errors name the judge."""
        cached = [name for name, c in configs.items() if c.cache]
        if cached and not redis_url:
            raise ValueError(
                f"[reward.judges] {cached} cache verdicts in Redis but [service] redis_url is empty: "
                "set redis_url, or cache = false for these judges"
            )
        client = ControlClient(redis_url) if cached else None
        judges: dict[str, Judge] = {}
        for name, c in configs.items():
            cache = VerdictCache(client, ttl_s=c.cache_ttl_s) if (c.cache and client is not None) else None
            judges[name] = Judge.from_config(name, c, cache=cache)
        return cls(judges, client)

    def for_env(self, env: str) -> Judge | None:
        return self._by_env.get(env)

    async def apply(self, scored: ScoredEpisode, episode: Episode) -> ScoredEpisode:
        """The scored episode with its env's judge's verdict (unchanged when no judge scores this env).

        `episode` is the full body (a stub's loaded body); an episode spoiled by an
        infrastructure failure is never judged (the learner drops it anyway).
        """
        judge = self.for_env(episode.env)
        if judge is None or episode.infra_error:
            return scored
        judgement = await judge.judge(JudgeInput.of(episode))
        return with_judgement(scored, judgement, judge.cfg.weight)

    def status(self) -> dict[str, Any]:
        """Per judge: model, rubric set and its counts."""
        return {
            name: {"model": j.cfg.model, "rubric_set": j.rubric_set.label, **asdict(j.stats)}
            for name, j in self.judges.items()
        }

    def cache_status(self) -> dict[str, Any] | None:
        """The verdict cache's Redis (password-free URL) and health; None without a cache."""
        c = self._cache_client
        return None if c is None else {"url": c.url, "healthy": c.healthy, "last_error": c.last_error}

    async def close(self) -> None:
        for j in self.judges.values():
            await j.close()
        if self._cache_client is not None:
            await self._cache_client.close()
