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
    import slipstream.supervised.warmstart as ws

    monkeypatch.setattr("slipstream.supervised.expert.EXPERT_CHUNK", 8)
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


def test_the_warm_start_plays_expert_episodes_only_as_its_steps_reach_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """A warm-start plays only the chunks of expert episodes its batches draw from (a code
    warm-start that stops at its probe's target had played every episode its cap could use), and
    its rows are the same prefix whatever the cap."""
    import slipstream.supervised.warmstart as ws
    from slipstream.engine import build_tiny

    monkeypatch.setattr("slipstream.supervised.expert.EXPERT_CHUNK", 4)
    env = TwoSamples()

    def train(steps: int) -> dict[str, object]:
        model, _ = build_tiny("micro", seed=1)
        return ws.sft_warmstart(model, TOK, env, steps=steps, batch_size=4, lr=1e-3, seed=5)

    few = train(3)
    # 3 steps x 4 rows = 12 examples at 2 an episode: 6 episodes, so two chunks of 4 distinct tasks.
    assert env.played == 8
    env.played = 0
    more = train(6)
    assert env.played == 12 and more["losses"][:1] == few["losses"][:1]


def test_a_pool_of_tasks_is_played_once_and_cycled_in_order() -> None:
    """`pool_tasks`: the expert plays that many tasks once and the steps go round their examples."""
    import slipstream.supervised.warmstart as ws
    from slipstream.engine import build_tiny

    env = TwoSamples()
    pool = env.generate("train", 3, seed=5)
    rows = ws._Rows(ws.expert_example_chunks(env, TOK, pool), cycle=True)
    once = ws.expert_examples(env, TOK, pool)
    assert len(once) == 6 and rows.take(0, 16) == (once * 3)[:16] and rows.take(16, 20) == (once * 4)[16:20]
    env.played = 0
    model, _ = build_tiny("micro", seed=1)
    figures = ws.sft_warmstart(model, TOK, env, steps=4, batch_size=4, lr=1e-3, seed=5, pool_tasks=3)
    assert env.played == 3 and figures["steps"] == 4 and figures["examples"] == 16
    with pytest.raises(ValueError, match="pool_tasks"):
        ws.sft_warmstart(model, TOK, env, steps=4, pool_tasks=-1)


class KeepsOne(TwoSamples):
    """A curating env that keeps one expert episode of all: its examples run out at once."""

    def curate_expert_episodes(self, tasks: list[TaskSpec], episodes: list[Episode]) -> list[bool]:
        return [i == 0 for i in range(len(episodes))]


def test_a_warm_start_whose_curated_examples_run_out_says_so() -> None:
    """A filter that keeps few episodes (search's keeps one per task) outran by the steps: an error
    naming the step and the fix, not an empty batch; with a pool the steps cycle over what was kept."""
    import slipstream.supervised.warmstart as ws
    from slipstream.engine import build_tiny

    model, _ = build_tiny("micro", seed=1)
    with pytest.raises(ValueError, match=r"examples ran out at step 1 of 3 .*sft_pool_tasks"):
        ws.sft_warmstart(model, TOK, KeepsOne(), steps=3, batch_size=4, lr=1e-3, seed=5)
    figures = ws.sft_warmstart(model, TOK, KeepsOne(), steps=3, batch_size=4, lr=1e-3, seed=5, pool_tasks=4)
    assert figures["steps"] == 3 and figures["examples"] == 12
