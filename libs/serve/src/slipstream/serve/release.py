"""The releaser: pending episodes out to `traj.raw.<env>`, with their signals, in groups.

Each pass (every `every_s`, in every endpoint replica; the pending store's transitions are
atomic, so replicas never form the same group twice):

1. `expire`: pending episodes past their deadline become ready (they have signals) or masked
   (none: counted, never published as reward 0 unless `publish_unrated`).
2. `form_group` until no group is left to form; each member is published: its stored body is
   read, its signals (`Episode.feedback`) and group (`group_id`, `group_index`, `group_size`) set,
   the body written back to its key and the stub published with `msg_id = episode_id`; only once
   JetStream has acked it is the episode marked released.
3. Members some releaser claimed more than `stale_after_s` ago and never marked released (it
   crashed between claim and publish, or between publish and mark) are published again: the same
   signals and group give the same bytes, and JetStream stores a message id once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Protocol

import msgspec

from slipstream.schemas import Episode, decode
from slipstream.schemas.subjects import traj_raw_subject
from slipstream.serve.pending import Member, PendingStore
from slipstream.store import ObjectStore
from slipstream.store.episodes import offload
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import REGISTRY

log = get_logger(__name__)

RELEASED = REGISTRY.counter("worker/serve/episodes_released", "Served episodes published with feedback, by env.")
MASKED = REGISTRY.counter("worker/serve/episodes_masked", "Served episodes with no feedback by the deadline, by env.")
RELEASE_FAILURES = REGISTRY.counter("worker/serve/release_failures", "Release attempts that failed (retried).")


class Publisher(Protocol):
    """What the releaser needs of the bus."""

    async def publish(self, subject: str, msg: msgspec.Struct, *, msg_id: str | None = None) -> int: ...


class Releaser:
    """Moves episodes from the pending store to the bus."""

    def __init__(
        self,
        pending: PendingStore,
        store: ObjectStore,
        bus: Publisher,
        *,
        stale_after_s: float = 30.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.pending = pending
        self.store = store
        self.bus = bus
        self.stale_after_s = stale_after_s
        self.clock = clock
        self.env = pending.policy.env
        self.released = 0
        self.masked = 0
        self.failures = 0

    async def step(self) -> int:
        """One pass; returns how many episodes were published."""
        now = self.clock()
        masked = await self.pending.expire(now)
        if masked:
            self.masked += len(masked)
            MASKED.add(len(masked), env=self.env)
            log.info("served episodes masked: no feedback by the deadline", n=len(masked), env=self.env)
        published = 0
        for member in await self.pending.stale_releasing(now, self.stale_after_s):
            published += await self._publish_counted(member)
        while group := await self.pending.form_group(self.clock()):
            for member in group:
                published += await self._publish_counted(member)
        return published

    async def _publish_counted(self, member: Member) -> int:
        try:
            await self.publish(member)
        except Exception as exc:  # store or bus trouble: the member stays claimed and is retried when stale
            self.failures += 1
            RELEASE_FAILURES.add(1)
            log.warning("release failed; retried later", episode_id=member.episode_id, error=repr(exc))
            return 0
        return 1

    async def publish(self, member: Member) -> Episode:
        """Write the member's body with its signals and group, publish its stub, mark it released."""
        body = await asyncio.to_thread(self.store.get, member.body_key)
        episode = decode(body, Episode)
        signals = await self.pending.feedback(member.episode_id)
        full = msgspec.structs.replace(
            episode,
            feedback=signals,
            group_id=member.group_id,
            group_index=member.group_index,
            group_size=member.group_size,
        )
        # A limit of 0 always goes by reference: the body is rewritten in place (same key) and the
        # bus carries the stub, whatever the episode's size.
        stub = await asyncio.to_thread(offload, self.store, full, 0)
        await self.bus.publish(traj_raw_subject(full.env), stub, msg_id=full.episode_id)
        await self.pending.released(member.episode_id)
        self.released += 1
        RELEASED.add(1, env=full.env)
        return stub

    async def run(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Pass every `every_s` until `stop`; one failed pass is logged and the next one retries."""
        while not stop.is_set():
            try:
                await self.step()
            except Exception as exc:  # Redis away: the state waits there, nothing is lost
                self.failures += 1
                RELEASE_FAILURES.add(1)
                log.warning("release pass failed", error=repr(exc))
            try:
                await asyncio.wait_for(stop.wait(), timeout=every_s)
            except TimeoutError:
                pass
