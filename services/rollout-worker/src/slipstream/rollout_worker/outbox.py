"""The sink: publish a task's trajectories to `traj.raw.<env>` and wait until JetStream has them.

Every trajectory is published with `msg_id = trajectory_id`, so a retried publish is stored once.
All of a group go out together (asynchronous publishes) and the call returns only when every one
is acknowledged by the stream; the caller acks the task after that and not before, so a crash
in between redelivers the task instead of losing its rollouts.

With tracing on, each trajectory is published inside its `rollout.generate` span (`spans.py`).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from slipstream.bus import Bus, PublishError
from slipstream.bus.tracing import tracing_active
from slipstream.rollout_worker.instruments import PUBLISHED
from slipstream.rollout_worker.spans import generation_span
from slipstream.schemas import Trajectory
from slipstream.schemas.subjects import traj_raw_subject


class Outbox:
    """Publishes groups of trajectories and confirms them."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.published = 0

    async def publish(self, trajectories: list[Trajectory]) -> None:
        """Publish all, await every ack; raises PublishError (the first failure) if any was not stored."""
        futures: list[asyncio.Future[int]] = []
        traced = tracing_active()
        try:
            for t in trajectories:
                if traced:
                    with generation_span(t):  # the trajectory's headers carry its generation span
                        futures.append(await self._send(t))
                else:
                    futures.append(await self._send(t))
        finally:
            # Collect every outcome (also after a failed send) so no future's error goes unobserved.
            results = await asyncio.gather(*futures, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            raise first if isinstance(first, PublishError) else PublishError(f"trajectory publish failed: {first!r}")
        self.published += len(trajectories)
        for env, n in Counter(t.env for t in trajectories).items():
            PUBLISHED.add(n, env=env)

    async def _send(self, t: Trajectory) -> asyncio.Future[int]:
        return await self.bus.publish_async(traj_raw_subject(t.env), t, msg_id=t.trajectory_id)
