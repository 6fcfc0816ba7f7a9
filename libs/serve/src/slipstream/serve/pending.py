"""The pending stage: where a served episode waits for its feedback, and how groups are formed.

Every episode the endpoint records goes through one small state machine, kept in a
`PendingStore` so that feedback posted to any endpoint replica reaches it (`RedisPending`, the
deployed one: DESIGN, Redis holds state) or, for tests and single-process use, in memory
(`MemoryPending`, same behaviour):

    open ──flush──> pending ──signal / deadline with signals──> ready ──group──> releasing ──> released
                       └──────────deadline, no signal─────────> masked

- **open**: the session is still being served; its calls resolve to the episode already (the
  episode id is fixed at the session's first call), so feedback that arrives before the flush is
  kept and attached at the flush.
- **pending**: the body is in the object store; the episode waits until it has a signal that
  counts (one of `reward_keys`, the keys the reward spec reads; empty: any key) and every key of
  `release_keys` (empty: none more), or until `feedback_deadline_s` passes.
- **ready**: waiting for a group. Serving traffic has no natural groups, so ready episodes are
  released `group_size` at a time (oldest first) under one fresh `group_id` (`<env>-<run>-<n>`):
  ids are assigned only when a whole group is there, so the learner never sees a group that is
  still filling (its `incomplete_group` timeout starts at the first member it receives, and all
  members are published together). With `group_wait_s` > 0 a smaller group goes once its oldest
  member has waited that long.
- **releasing**: the group is fixed and so are the signals (later feedback is answered 409); the
  releaser writes the body with them and publishes the stub. A crash here leaves the episode in
  `releasing`, and the next releaser pass publishes it again with the same bytes and
  `msg_id = episode_id`, which JetStream stores once.
- **masked**: no signal that counts by the deadline, so the reward spec could not score it.
  Never published as reward 0 (counted): one the spec would mask downstream would also keep its
  whole group from completing at the learner. With
  `publish_unrated` it is published anyway, for a reward spec whose components have defaults.

Feedback is idempotent: a signal is stored once per `feedback_id` (without one, per digest of
its target, key, source and value), a second post is answered "duplicate".
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import msgspec

from slipstream.schemas import FeedbackSignal

Verdict = Literal["recorded", "duplicate", "too_late", "unknown"]
OPEN_STATES = ("open", "pending", "ready")  # feedback still changes what is published


class Member(msgspec.Struct, frozen=True, kw_only=True):
    """An episode of a formed group, to be published."""

    episode_id: str
    body_key: str
    group_id: str
    group_index: int
    group_size: int


class PendingPolicy(msgspec.Struct, frozen=True, kw_only=True):
    """What the pending stage needs from `[endpoint]` and the run."""

    env: str = "serve"
    run_id: str = ""
    release_keys: tuple[str, ...] = ()
    reward_keys: tuple[str, ...] = ()
    publish_unrated: bool = False
    group_size: int = 8
    group_wait_s: float = 0.0
    retention_s: float = 86400.0

    def group_id(self, n: int) -> str:
        return f"{self.env}-{self.run_id or 'default'}-{n}"


class PendingStore(Protocol):
    """The pending stage's state; every method is atomic with respect to every other caller."""

    policy: PendingPolicy

    async def next_episode(self, session_id: str) -> int:
        """A fresh episode number for the session (never reused, also across replicas and restarts)."""
        ...

    async def note_call(self, call_id: str, session_id: str, episode_id: str) -> None:
        """A call was served into `episode_id` (opened if new); it becomes the session's last call."""
        ...

    async def last_call(self, session_id: str) -> str | None: ...

    async def episode_of_call(self, call_id: str) -> str | None: ...

    async def state(self, episode_id: str) -> str | None:
        """The episode's state (`open`, `pending`, ...) or None when unknown."""
        ...

    async def add_feedback(self, episode_id: str, signal: FeedbackSignal, now: float) -> Verdict: ...

    async def flushed(self, episode_id: str, body_key: str, deadline: float, now: float) -> str:
        """The body is stored: open -> pending (or straight to ready); returns the new state."""
        ...

    async def expire(self, now: float) -> list[str]:
        """Pending episodes past their deadline become ready (with signals) or masked; returns the masked."""
        ...

    async def form_group(self, now: float) -> list[Member]:
        """Claim the next group of ready episodes ([] when there is none to form yet)."""
        ...

    async def stale_releasing(self, now: float, older_than_s: float) -> list[Member]:
        """Members claimed more than `older_than_s` ago and still not released (a releaser died)."""
        ...

    async def feedback(self, episode_id: str) -> list[FeedbackSignal]:
        """The episode's signals, in the order recorded."""
        ...

    async def released(self, episode_id: str) -> None: ...

    async def counts(self) -> dict[str, int]: ...

    async def close(self) -> None: ...


def ordered(signals: list[FeedbackSignal]) -> list[FeedbackSignal]:
    """Signals in a fixed order (time recorded, then id): a re-publish writes the same bytes."""
    return sorted(signals, key=lambda s: (s.at, s.feedback_id))


def counts(keys: set[str], policy: PendingPolicy) -> bool:
    """Does an episode with signals of these keys have one the reward spec reads?"""
    return bool(keys & set(policy.reward_keys)) if policy.reward_keys else bool(keys)


def releasable(keys: set[str], policy: PendingPolicy) -> bool:
    return counts(keys, policy) and all(k in keys for k in policy.release_keys)


@dataclass
class _Ep:
    state: str = "open"
    body_key: str = ""
    deadline: float = 0.0
    ready_at: float = 0.0
    claimed_at: float = 0.0
    group: tuple[str, int, int] = ("", 0, 0)
    signals: dict[str, FeedbackSignal] = field(default_factory=dict)


class MemoryPending:
    """The pending stage in process memory: one replica, state lost on exit (tests, benchmarks,
    a single serving worker without Redis). Calls and finished episodes are forgotten
    `retention_s` after (wall clock), as their Redis keys expire."""

    def __init__(self, policy: PendingPolicy, clock: Callable[[], float] = time.time) -> None:
        self.policy = policy
        self.clock = clock
        self._eps: dict[str, _Ep] = {}
        # Insertion order is time order: the oldest entries are pruned from the front.
        self._calls: dict[str, tuple[str, float]] = {}  # call -> (episode, noted at)
        self._last: dict[str, tuple[str, float]] = {}  # session -> (latest call, noted at)
        self._done: deque[tuple[float, str]] = deque()  # (released or masked at, episode)
        self._numbers: Counter[str] = Counter()
        self._groups = 0
        self._counts: Counter[str] = Counter()

    def _prune(self) -> None:
        cutoff = self.clock() - self.policy.retention_s
        for table in (self._calls, self._last):
            while table and next(iter(table.values()))[1] < cutoff:
                del table[next(iter(table))]
        while self._done and self._done[0][0] < cutoff:
            _, eid = self._done.popleft()
            ep = self._eps.get(eid)
            if ep is not None and ep.state in ("released", "masked"):
                del self._eps[eid]

    def _finish(self, eid: str, ep: _Ep, state: str) -> None:
        ep.state = state
        self._counts[state] += 1
        self._done.append((self.clock(), eid))

    async def next_episode(self, session_id: str) -> int:
        n = self._numbers[session_id]
        self._numbers[session_id] += 1
        return n

    async def note_call(self, call_id: str, session_id: str, episode_id: str) -> None:
        self._prune()
        now = self.clock()
        self._eps.setdefault(episode_id, _Ep())
        self._calls[call_id] = (episode_id, now)
        self._last.pop(session_id, None)  # re-inserted at the end: the table stays in time order
        self._last[session_id] = (call_id, now)

    async def last_call(self, session_id: str) -> str | None:
        got = self._last.get(session_id)
        return None if got is None else got[0]

    async def episode_of_call(self, call_id: str) -> str | None:
        got = self._calls.get(call_id)
        return None if got is None else got[0]

    async def state(self, episode_id: str) -> str | None:
        ep = self._eps.get(episode_id)
        return None if ep is None else ep.state

    async def add_feedback(self, episode_id: str, signal: FeedbackSignal, now: float) -> Verdict:
        ep = self._eps.get(episode_id)
        if ep is None:
            return "unknown"
        if signal.feedback_id in ep.signals:
            return "duplicate"
        if ep.state not in OPEN_STATES:
            return "too_late"
        ep.signals[signal.feedback_id] = signal
        self._counts["feedback"] += 1
        if ep.state == "pending" and releasable({s.key for s in ep.signals.values()}, self.policy):
            ep.state, ep.ready_at = "ready", now
        return "recorded"

    async def flushed(self, episode_id: str, body_key: str, deadline: float, now: float) -> str:
        ep = self._eps.setdefault(episode_id, _Ep())
        if ep.state != "open":
            return ep.state
        ep.body_key, ep.deadline = body_key, deadline
        ep.state = "pending"
        self._counts["flushed"] += 1
        if releasable({s.key for s in ep.signals.values()}, self.policy):
            ep.state, ep.ready_at = "ready", now
        return ep.state

    async def expire(self, now: float) -> list[str]:
        self._prune()
        masked = []
        for eid, ep in self._eps.items():
            if ep.state != "pending" or ep.deadline > now:
                continue
            if counts({s.key for s in ep.signals.values()}, self.policy) or self.policy.publish_unrated:
                ep.state, ep.ready_at = "ready", now
            else:
                self._finish(eid, ep, "masked")
                masked.append(eid)
        return masked

    async def form_group(self, now: float) -> list[Member]:
        ready = sorted((ep.ready_at, eid) for eid, ep in self._eps.items() if ep.state == "ready")
        size = self.policy.group_size
        if not ready:
            return []
        waited = now - ready[0][0]
        if len(ready) < size and not (self.policy.group_wait_s > 0 and waited >= self.policy.group_wait_s):
            return []
        take = [eid for _, eid in ready[:size]]
        self._groups += 1
        gid = self.policy.group_id(self._groups)
        out = []
        for i, eid in enumerate(take):
            ep = self._eps[eid]
            ep.state, ep.claimed_at, ep.group = "releasing", now, (gid, i, len(take))
            out.append(self._member(eid, ep))
        return out

    def _member(self, eid: str, ep: _Ep) -> Member:
        gid, index, size = ep.group
        return Member(episode_id=eid, body_key=ep.body_key, group_id=gid, group_index=index, group_size=size)

    async def stale_releasing(self, now: float, older_than_s: float) -> list[Member]:
        return [
            self._member(eid, ep)
            for eid, ep in self._eps.items()
            if ep.state == "releasing" and now - ep.claimed_at >= older_than_s
        ]

    async def feedback(self, episode_id: str) -> list[FeedbackSignal]:
        ep = self._eps.get(episode_id)
        return [] if ep is None else ordered(list(ep.signals.values()))

    async def released(self, episode_id: str) -> None:
        ep = self._eps.get(episode_id)
        if ep is not None and ep.state == "releasing":
            self._finish(episode_id, ep, "released")

    async def counts(self) -> dict[str, int]:
        states = Counter(ep.state for ep in self._eps.values())
        return {**{f"state_{k}": v for k, v in states.items()}, **self._counts}

    async def close(self) -> None:
        return None
