"""The sink: publish a task's episodes to `traj.raw.<env>` and wait until JetStream has them.

Every episode is published with `msg_id = episode_id`, so a retried publish is stored once.
An episode whose encoded size would pass the bus limit goes by reference: its body is written to
the object store first (`slipstream.store.episodes.offload`) and the bus carries its stub. All of
a group go out together (asynchronous publishes) and the call returns only when every one is
acknowledged by the stream; the caller acks the task after that and not before, so a crash in
between redelivers the task instead of losing its rollouts.

With tracing on, each episode is published inside its `rollout.generate` span (`spans.py`).
"""

from __future__ import annotations

import asyncio
from collections import Counter

from slipstream.bus import Bus, PublishError
from slipstream.bus.tracing import tracing_active
from slipstream.rollout_worker.instruments import OFFLOADED, PUBLISHED
from slipstream.rollout_worker.spans import generation_span
from slipstream.schemas import Episode
from slipstream.schemas.subjects import traj_raw_subject
from slipstream.store import ObjectStore
from slipstream.store.episodes import offload


class Outbox:
    """Publishes groups of episodes (big ones by reference) and confirms them."""

    def __init__(self, bus: Bus, store: ObjectStore | None = None) -> None:
        self.bus = bus
        self.store = store
        self.published = 0
        self.offloaded = 0

    async def publish(self, episodes: list[Episode]) -> None:
        """Publish all, await every ack; raises PublishError (the first failure) if any was not stored."""
        outgoing = [await self._by_reference_if_big(e) for e in episodes]
        futures: list[asyncio.Future[int]] = []
        traced = tracing_active()
        try:
            for full, sent in zip(episodes, outgoing, strict=True):
                if traced:
                    with generation_span(full):  # the episode's headers carry its generation span
                        futures.append(await self._send(sent))
                else:
                    futures.append(await self._send(sent))
        finally:
            # Collect every outcome (also after a failed send) so no future's error goes unobserved.
            results = await asyncio.gather(*futures, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            first = errors[0]
            raise first if isinstance(first, PublishError) else PublishError(f"episode publish failed: {first!r}")
        self.published += len(episodes)
        for env, n in Counter(e.env for e in episodes).items():
            PUBLISHED.add(n, env=env)

    async def _by_reference_if_big(self, episode: Episode) -> Episode:
        if self.store is None:
            return episode  # no store: an oversized episode fails its publish (PayloadTooLarge), the task is nak'd
        sent = await asyncio.to_thread(offload, self.store, episode, self.bus.max_payload)
        if sent.is_stub():
            self.offloaded += 1
            OFFLOADED.add(1, env=episode.env)
        return sent

    async def _send(self, e: Episode) -> asyncio.Future[int]:
        return await self.bus.publish_async(traj_raw_subject(e.env), e, msg_id=e.episode_id)
