"""What the endpoint records: one `CallRecord` per served call, sessions flushed as episodes.

Recording happens at the boundary and assembly afterwards (a recorder, not a live token buffer):

- `Recorder.begin(session, key)` coalesces retries. A request that carries an idempotency key,
  or that the SDK marks as a retry (`x-stainless-retry-count` > 0), is keyed by (session, key or
  body hash). If that key was already served, the caller gets the recorded call back and replays
  it (same ids, same text) instead of sampling again; if it is still being served, the caller
  waits for it. Either way the call is recorded once. A first attempt with a body seen before is
  a new call (a user may ask the same thing twice).
- `await Recorder.record(call)` appends to its session's open episode and returns its id. The
  id (`serve/<session>/<n>`) is fixed at the session's first call, with `n` from the pending
  store (never reused, across replicas and restarts), so feedback can target the episode while
  it is still open. A session idle for `session_idle_s` (or all, on `flush_all`, at shutdown) is
  assembled into one `Episode` (`slipstream.serve.episodes`), handed to an `EpisodeSink`, and
  enters the pending stage (`slipstream.serve.pending`) to wait for its feedback; a session
  whose calls name a prompt group (`CallRecord.group_key`) enters it with that key, and is
  released with the key's other episodes.

Sinks: `MemorySink` (tests), `StoreSink` (the object store: the encoded Episode under
`episode_key(run_id, episode_id)`, the by-reference body layout of `slipstream.store.episodes`, so
the releaser (`slipstream.serve.release`) can publish stubs on the bus without copying bytes).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Protocol

from slipstream.schemas import Episode, encode
from slipstream.serve.call_record import CallRecord
from slipstream.serve.episodes import assemble
from slipstream.serve.pending import MemoryPending, PendingPolicy, PendingStore
from slipstream.store import ObjectStore
from slipstream.store.episodes import episode_key
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)


class EpisodeSink(Protocol):
    """Where assembled episodes go; `put` returns the object-store key of the body ('' if none)."""

    async def put(self, episode: Episode) -> str: ...


class MemorySink:
    """Keeps episodes in a list (tests, benchmarks)."""

    def __init__(self) -> None:
        self.episodes: list[Episode] = []

    async def put(self, episode: Episode) -> str:
        self.episodes.append(episode)
        return ""


class StoreSink:
    """Writes each episode's encoded body to the object store (DESIGN: the store holds bytes)."""

    def __init__(self, store: ObjectStore, run_id: str) -> None:
        self.store = store
        self.run_id = run_id
        self.written: list[str] = []

    async def put(self, episode: Episode) -> str:
        key = episode_key(self.run_id, episode.episode_id)
        await asyncio.to_thread(self.store.put, key, encode(episode))
        self.written.append(key)
        return key


class Recorder:
    """Call ledger, retry coalescing and per-session episode assembly."""

    def __init__(
        self,
        sink: EpisodeSink,
        *,
        env: str = "serve",
        run_id: str = "",
        worker_id: str = "",
        session_idle_s: float = 300.0,
        replay_window: int = 4096,
        clock: Callable[[], float] = time.time,
        pending: PendingStore | None = None,
        feedback_deadline_s: float = 600.0,
    ) -> None:
        self.sink = sink
        self.env = env
        self.run_id = run_id
        self.worker_id = worker_id
        self.session_idle_s = session_idle_s
        self.replay_window = replay_window
        self.clock = clock
        self.pending: PendingStore = pending or MemoryPending(PendingPolicy(env=env, run_id=run_id))
        self.feedback_deadline_s = feedback_deadline_s
        # The latest recorded calls, for inspection (tests, /readyz); sessions hold their own.
        self.calls: deque[CallRecord] = deque(maxlen=replay_window)
        self._sessions: dict[str, list[CallRecord]] = {}
        self._last_seen: dict[str, float] = {}
        self._open: dict[str, str] = {}  # session -> the id of its open episode
        self._keys: OrderedDict[str, asyncio.Future[CallRecord]] = OrderedDict()
        self.recorded = 0
        self.unmapped = 0  # calls recorded while the pending store was away (feedback cannot target them)
        self.flush_failures = 0
        self._retry: list[tuple[Episode, str | None]] = []  # flushed episodes not yet stored / pending
        self.coalesced = 0
        self.episodes = 0

    # ------------------------------------------------------------------ retries
    def begin(self, session_id: str, key: str, *, replace: bool = False) -> asyncio.Future[CallRecord] | None:
        """The earlier call under `key` (await it to replay), or None: the caller serves it, then
        `finish(...)` or `fail(...)`. With `replace` (a first attempt) any earlier call is ignored."""
        full = f"{session_id}\x00{key}"
        prior = None if replace else self._keys.get(full)
        if prior is not None and not (prior.done() and (prior.cancelled() or prior.exception() is not None)):
            self.coalesced += 1
            return prior
        self._keys[full] = asyncio.get_running_loop().create_future()
        self._keys.move_to_end(full)
        while len(self._keys) > self.replay_window:
            _, old = self._keys.popitem(last=False)
            if not old.done():
                old.cancel()
        return None

    def finish(self, session_id: str, key: str, record: CallRecord) -> None:
        fut = self._keys.get(f"{session_id}\x00{key}")
        if fut is not None and not fut.done():
            fut.set_result(record)

    def fail(self, session_id: str, key: str, exc: BaseException) -> None:
        fut = self._keys.pop(f"{session_id}\x00{key}", None)
        if fut is not None and not fut.done():
            fut.set_exception(exc)
            fut.exception()  # retrieved: a waiter re-raises it, nobody else must log it as lost

    # ------------------------------------------------------------------ recording
    async def record(self, call: CallRecord) -> str:
        """Append the call to its session's open episode (opened now if none); returns the episode id."""
        sid = call.session_id
        if sid not in self._open:
            n = await self.pending.next_episode(sid)
            # Another call of the session may have opened it meanwhile: that one stands (n is skipped).
            self._open.setdefault(sid, f"serve/{sid}/{n}")
        episode_id = self._open[sid]
        self.calls.append(call)
        self._sessions.setdefault(sid, []).append(call)
        self._last_seen[sid] = self.clock()
        self.recorded += 1
        try:
            await self.pending.note_call(call.call_id, sid, episode_id)
        except Exception as exc:  # the pending store away: the call is kept, only feedback cannot find it
            self.unmapped += 1
            log.warning("serve: call not noted in the pending store", call_id=call.call_id, error=repr(exc))
        return episode_id

    def session_calls(self, session_id: str) -> list[CallRecord]:
        return list(self._sessions.get(session_id, []))

    async def flush(self, session_id: str) -> Episode | None:
        """Assemble the session's calls so far into one episode and hand it to the sink."""
        calls = self._sessions.pop(session_id, None)
        self._last_seen.pop(session_id, None)
        episode_id = self._open.pop(session_id, None)
        if not calls or episode_id is None:
            return None
        episode = assemble(episode_id, calls, env=self.env, run_id=self.run_id, worker_id=self.worker_id)
        self.episodes += 1
        await self._store(episode, None)
        return episode

    async def _store(self, episode: Episode, body_key: str | None) -> bool:
        """Body to the sink, then the episode to the pending stage; a failed step is retried on the
        next sweep (`body_key` set: the body is already stored). Stored first, then pending: a
        crash in between leaves a stored body that is never published (its episode stays open in
        the pending store until it expires), never a pending episode without a body."""
        try:
            if body_key is None:
                body_key = await self.sink.put(episode)
            now = self.clock()
            group = episode.metadata.get("group_key", "")
            size = int(episode.metadata.get("group_size", "0"))
            await self.pending.flushed(
                episode.episode_id, body_key, now + self.feedback_deadline_s, now, group_key=group, group_size=size
            )
        except Exception as exc:  # the store or the pending store away: kept here and retried
            self.flush_failures += 1
            self._retry.append((episode, body_key))
            log.warning("serve: episode not stored yet; retried", episode_id=episode.episode_id, error=repr(exc))
            return False
        return True

    async def retry_failed(self) -> int:
        """Store what earlier flushes could not; returns how many are still waiting."""
        waiting, self._retry = self._retry, []
        for episode, body_key in waiting:
            await self._store(episode, body_key)
        return len(self._retry)

    async def flush_idle(self) -> int:
        """Flush every session idle for `session_idle_s`; returns how many."""
        await self.retry_failed()
        now = self.clock()
        idle = [s for s, t in self._last_seen.items() if now - t >= self.session_idle_s]
        for s in idle:
            await self.flush(s)
        return len(idle)

    async def flush_all(self) -> int:
        sessions = list(self._sessions)
        for s in sessions:
            await self.flush(s)
        if await self.retry_failed():
            log.error("serve: episodes could not be stored at shutdown", lost=len(self._retry))
        return len(sessions)

    async def sweep(self, stop: asyncio.Event, every_s: float = 1.0) -> None:
        """Flush idle sessions until `stop` is set, then everything."""
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), timeout=every_s)
            except TimeoutError:
                pass
            await self.flush_idle()
        await self.flush_all()

    def stats(self) -> dict[str, int]:
        return {
            "calls_recorded": self.recorded,
            "retries_coalesced": self.coalesced,
            "sessions_open": len(self._sessions),
            "episodes_flushed": self.episodes,
            "calls_unmapped": self.unmapped,
            "flush_failures": self.flush_failures,
        }
