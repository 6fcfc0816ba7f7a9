"""A serving worker's follower notes how far the learner is ahead (admission control, issue 16).

In promoted mode with `track_announced` the follower reads announces only for their version:
nothing is fetched or applied, another run's announce and a refused one are not counted.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from slipstream.rollout_worker.follower import WeightFollower
from slipstream.schemas import WeightAnnounce

pytestmark = pytest.mark.unit


class Verifier:
    """Refuses announces of the versions it is told to (the real one checks signatures and fences)."""

    def __init__(self, refuse: set[int]) -> None:
        self.refuse = refuse

    async def verify(self, announce: WeightAnnounce) -> Any:
        return SimpleNamespace(ok=announce.policy_version not in self.refuse)


def announce(version: int, run: str = "r") -> WeightAnnounce:
    return WeightAnnounce(policy_version=version, manifest_key=f"{run}/weights/v{version}", run_id=run)


async def test_announced_versions_are_noted_not_applied() -> None:
    engine = SimpleNamespace(policy_version=2)
    f = WeightFollower(
        cast(Any, None),
        cast(Any, None),
        cast(Any, engine),
        run_id="r",
        retries=0,
        backoff_s=0.0,
        mode="promoted",
        verifier=cast(Any, Verifier(refuse={9})),
        track_announced=True,
    )
    assert f.track_announced and f.newest_version() == 2
    assert await f.note_announced(announce(5)) and f.newest_version() == 5
    assert not await f.note_announced(announce(4))  # older: nothing changes
    assert not await f.note_announced(announce(7, run="other"))
    assert not await f.note_announced(announce(9))  # refused by the verifier: a forgery cannot stall serving
    assert f.newest_version() == 5 and engine.policy_version == 2 and f._newest is None  # nothing to apply
    latest = WeightFollower(
        cast(Any, None), cast(Any, None), cast(Any, engine), run_id="r", retries=0, backoff_s=0.0, track_announced=True
    )
    assert not latest.track_announced  # latest mode reads announces anyway
