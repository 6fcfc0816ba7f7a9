"""`expert_episodes` keeps at most `concurrency` of the expert's episodes in flight, and the bound
changes no episode (an env whose tools start processes, `code`, timed out every call at 6,400)."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.engine import ByteTokenizer
from slipstream.envs.context import EpisodeContext, Outcome
from slipstream.envs.lookup import Lookup
from slipstream.supervised import expert_episodes

pytestmark = pytest.mark.unit

TOK = ByteTokenizer()


class Counting(Lookup):
    """lookup, counting its episodes in flight (each yields to the loop before it plays)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.peak = 0

    async def run(self, ctx: EpisodeContext) -> Outcome:
        self.now += 1
        self.peak = max(self.peak, self.now)
        try:
            await asyncio.sleep(0.001)
            return await super().run(ctx)
        finally:
            self.now -= 1


async def test_at_most_concurrency_expert_episodes_are_in_flight_and_none_changes() -> None:
    env = Counting()
    tasks = env.generate("train", 40, seed=2)
    bounded = await expert_episodes(env, TOK, tasks, concurrency=3)
    assert env.peak == 3
    env.peak = 0
    unbounded = await expert_episodes(env, TOK, tasks, concurrency=40)
    assert env.peak == 40
    assert [e.final_text for e in bounded] == [e.final_text for e in unbounded]
    assert [[s.ids() for s in e.samples] for e in bounded] == [[s.ids() for s in e.samples] for e in unbounded]
    with pytest.raises(ValueError, match="concurrency"):
        await expert_episodes(env, TOK, tasks, concurrency=0)
