"""`expert_examples(limit=)`: only the episodes whose examples the warm-start uses are played,
and the examples are the same prefix as without a limit (the swarm's episodes give ~5 each)."""

from __future__ import annotations

from typing import ClassVar

import pytest
from agentic_envs import SummaryRestart

from slipstream.engine import ByteTokenizer
from slipstream.envs.base import TaskSpec
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.schemas import Episode

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()


class TwoSamples(SummaryRestart):
    """Two trainable samples an episode (a draft, then an answer after a summary), counted."""

    warmstart_from_expert: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.played = 0

    def expert(self, task: TaskSpec, context: str) -> str:
        return task.reference + "\n"

    async def run(self, ctx: EpisodeContext) -> Outcome:
        self.played += 1
        return await super().run(ctx)


class Curated(TwoSamples):
    def curate_expert_episodes(self, tasks: list[TaskSpec], episodes: list[Episode]) -> list[bool]:
        return [i % 2 == 0 for i in range(len(episodes))]


def test_a_limit_plays_only_the_episodes_the_warm_start_uses_and_keeps_the_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import slipstream.harness.warmstart as ws

    monkeypatch.setattr(ws, "EXPERT_CHUNK", 8)
    env = TwoSamples()
    tasks = env.generate("train", 120, seed=3)
    distinct = len({t.metadata["key"] for t in tasks})
    full = ws.expert_examples(env, TOK, tasks)
    assert env.played == distinct > 40 and len(full) == 2 * len(tasks)
    env.played = 0
    limited = ws.expert_examples(env, TOK, tasks, limit=21)
    assert 21 <= len(limited) < len(full) and limited == full[: len(limited)]
    assert env.played <= 16  # two chunks of 8 distinct tasks give >= 21 examples
    # A limit past the end is every example.
    assert ws.expert_examples(env, TOK, tasks, limit=10_000) == full
    # A curating env's filter sees every episode at once: the limit does not apply.
    curated = Curated()
    everything = ws.expert_examples(curated, TOK, tasks)
    curated.played = 0
    assert ws.expert_examples(curated, TOK, tasks, limit=5) == everything
    assert curated.played == distinct
