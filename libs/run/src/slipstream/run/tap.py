"""Watching a run's trajectory subjects from before its first message: ids for the accounting, version spans.

A plain (non-JetStream) NATS subscription sees only what is published while it exists, and the
trajectory streams are work queues (a message is gone once acked, so nothing can be replayed
later). The tap therefore subscribes to `traj.raw.>` and `traj.scored.>` as soon as the run's
nats-server is up, before any service could publish, on a thread with its own event loop (the
main thread runs the stack's processes and must fork them itself).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Mapping
from typing import Any

from slipstream.bus.envelope import MSG_ID_HEADER
from slipstream.schemas import SCHEMA_HEADER, Episode, decode_message


class TapError(RuntimeError):
    """The tap could not subscribe (the run's nats-server did not answer)."""


class TapIds:
    """Which scored messages are the reward-model's work and which came from outside.

    The reward-model publishes each scored episode with the raw message's `Nats-Msg-Id` (the
    episode id). A message on `traj.scored.>` whose id no raw message carried (or with no id at
    all) was put there by someone else: it is in the scored stream's count but not in what the
    reward-model took off the raw stream. Ids are counted once however often they were published
    (JetStream stores a repeat inside its duplicate window once).
    """

    def __init__(self) -> None:
        self.raw_ids: set[str] = set()
        self.scored_ids: set[str] = set()
        self.scored_without_id = 0

    def raw(self, headers: dict[str, str] | None) -> None:
        msg_id = (headers or {}).get(MSG_ID_HEADER)
        if msg_id:
            self.raw_ids.add(msg_id)

    def scored(self, headers: dict[str, str] | None) -> None:
        msg_id = (headers or {}).get(MSG_ID_HEADER)
        if msg_id:
            self.scored_ids.add(msg_id)
        else:
            self.scored_without_id += 1

    @property
    def injected_scored(self) -> int:
        """Messages published on traj.scored.> that no raw trajectory of the run accounts for."""
        return self.untraced()

    def untraced(self, settled: frozenset[str] | set[str] = frozenset()) -> int:
        """`injected_scored`, less the ids in `settled` (trajectories the learner's outcome log names).

        The tap is a core subscription: while nats-server restarts it is reconnecting and misses
        what is published then, so a worker's episode published in that gap is a scored id without
        a raw one. The learner decoded and settled it as a trajectory, so it is the reward-model's
        work, not an outsider's (an outsider's garbage is dead-lettered, never settled).
        """
        return len(self.scored_ids - self.raw_ids - set(settled)) + self.scored_without_id


class Tap:
    """The two subscriptions, on their own thread; `start()` returns once the server has them."""

    def __init__(self, url: str, options: Mapping[str, Any] | None = None) -> None:
        self.url = url
        self._options = dict(options or {})  # the admin's credentials on a stack with users
        self.ids = TapIds()
        self.tapped = 0
        """Messages seen on traj.raw.> (repeats of a publish included)."""
        self.spanning = 0
        """Episodes sampled under more than one policy version (mid-rollout weight refresh)."""
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._quit: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self, timeout_s: float = 15.0) -> Tap:
        self._thread = threading.Thread(target=self._run, name="slipstream-tap", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TapError(f"the trajectory tap could not subscribe at {self.url} within {timeout_s:.0f} s")
        if self._error is not None:
            raise TapError(f"the trajectory tap could not subscribe at {self.url}: {self._error!r}")
        return self

    def stop(self) -> None:
        """Unsubscribe and end the thread (idempotent); the counts stay readable."""
        loop, quit_ = self._loop, self._quit
        if loop is not None and quit_ is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended between the check and the call
                loop.call_soon_threadsafe(quit_.set)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def injected_scored(self, settled: frozenset[str] | set[str] = frozenset()) -> int:
        with self._lock:
            return self.ids.untraced(settled)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start(), or lost with a stopping run
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        from nats.aio.client import Client

        self._loop = asyncio.get_running_loop()
        self._quit = asyncio.Event()
        nc = Client()
        try:  # connect inside: a connect that fails half-way may hold a socket too
            servers = [u.strip() for u in self.url.split(",") if u.strip()]  # a cluster: every node
            await nc.connect(servers=servers, name="follow-tap", **self._options)
            await nc.subscribe("traj.raw.>", cb=self._on_raw)
            await nc.subscribe("traj.scored.>", cb=self._on_scored)
            await nc.flush()
            self._ready.set()
            await self._quit.wait()
        finally:
            if nc.is_connected or nc.is_connecting or nc.is_reconnecting or nc.is_draining:
                await nc.close()  # (a client that never got as far as a socket cannot be closed)

    async def _on_raw(self, msg: Any) -> None:
        with self._lock:
            self.tapped += 1
            self.ids.raw(msg.headers)
        with contextlib.suppress(Exception):  # a malformed message is the DLQ's business, not ours
            episode = decode_message(msg.data, (msg.headers or {}).get(SCHEMA_HEADER), Episode)
            # An episode (any producer's: a v1 trajectory is upgraded) sampled under more than one version.
            if len({seg.policy_version for s in episode.samples for seg in s.segments}) > 1:
                self.spanning += 1

    async def _on_scored(self, msg: Any) -> None:
        with self._lock:
            self.ids.scored(msg.headers)
