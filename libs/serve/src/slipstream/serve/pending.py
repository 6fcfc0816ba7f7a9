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
- **ready**: waiting for a group, formed one of two ways (ids are assigned only when a group is
  formed, and all its members are published together, so the learner never sees a group that is
  still filling: its `incomplete_group` timeout starts at the first member it receives):
  - **per prompt**: an episode flushed with a group key (the n rollouts of one `n` > 1 call, or
    the separate calls a client tagged with one `x-slipstream-group`) waits for the other members
    of its key. The key asks for `want` members (n, the client's `x-slipstream-group-size`, else
    `group_size`); the group is formed as soon as `want` of them are done (ready, or masked: those
    never publish), with the ready ones, oldest first. If they are not all done
    `group_timeout_s` after the first one became ready, the group is released *smaller*, with
    the members that are ready (counted in `groups_partial`): the learner still gets a
    per-prompt baseline over them, and no rated episode is thrown away. Either way the key then
    starts over: a member that becomes ready later waits for a group of its own (the same rule),
    and a client may reuse a key for its next prompt.
  - **in arrival order**: episodes without a key (ordinary serving traffic has no natural
    groups) are released `group_size` at a time (oldest first) under one fresh `group_id`
    (`<env>-<run>-<n>`); with `group_wait_s` > 0 a smaller group goes once its oldest member has
    waited that long.
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

import bisect
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
    group_timeout_s: float = 600.0
    retention_s: float = 86400.0

    def want(self, group_size: int) -> int:
        """Members a group key asks for: the size it was sent with, else `group_size`."""
        return group_size if group_size > 0 else self.group_size

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

    async def flushed(
        self, episode_id: str, body_key: str, deadline: float, now: float, group_key: str = "", group_size: int = 0
    ) -> str:
        """The body is stored: open -> pending (or straight to ready); returns the new state.

        With a `group_key` the episode is released with the other episodes of that key (a group
        of `group_size` members; 0: the policy's `group_size`), not in arrival order."""
        ...

    async def expire(self, now: float) -> list[str]:
        """Pending episodes past their deadline become ready (with signals) or masked; returns the masked."""
        ...

    async def form_group(self, now: float) -> list[Member]:
        """Claim the next group of ready episodes ([] when there is none to form yet): a keyed
        group that is complete or past `group_timeout_s` first, then one in arrival order."""
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
    group_key: str = ""
    group_want: int = 0


@dataclass
class _Key:
    """A group key's round: members it asks for, members masked this round, last touched."""

    want: int
    gone: int = 0
    touched: float = 0.0
    ready: list[tuple[float, str]] = field(default_factory=list)  # (ready at, episode), in order


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
        self._keys: dict[str, _Key] = {}
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
        for key in [k for k, g in self._keys.items() if not g.ready and g.touched < cutoff]:
            del self._keys[key]

    def _finish(self, eid: str, ep: _Ep, state: str) -> None:
        ep.state = state
        self._counts[state] += 1
        self._done.append((self.clock(), eid))
        if ep.group_key and state == "masked":
            self._key(ep).gone += 1  # it will never publish: its group need not wait for it

    def _key(self, ep: _Ep) -> _Key:
        """The episode's group key, touched now (made again if it was forgotten meanwhile)."""
        group = self._keys.setdefault(ep.group_key, _Key(want=ep.group_want))
        group.touched = self.clock()
        return group

    def _ready(self, eid: str, ep: _Ep, now: float) -> None:
        ep.state, ep.ready_at = "ready", now
        if ep.group_key:
            bisect.insort(self._key(ep).ready, (now, eid))

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
            self._ready(episode_id, ep, now)
        return "recorded"

    async def flushed(
        self, episode_id: str, body_key: str, deadline: float, now: float, group_key: str = "", group_size: int = 0
    ) -> str:
        ep = self._eps.setdefault(episode_id, _Ep())
        if ep.state != "open":
            return ep.state
        ep.body_key, ep.deadline = body_key, deadline
        ep.group_key, ep.group_want = group_key, self.policy.want(group_size)
        ep.state = "pending"
        self._counts["flushed"] += 1
        if group_key:
            self._key(ep)  # the first member to arrive fixes how many the key asks for
        if releasable({s.key for s in ep.signals.values()}, self.policy):
            self._ready(episode_id, ep, now)
        return ep.state

    async def expire(self, now: float) -> list[str]:
        self._prune()
        masked = []
        for eid, ep in self._eps.items():
            if ep.state != "pending" or ep.deadline > now:
                continue
            if counts({s.key for s in ep.signals.values()}, self.policy) or self.policy.publish_unrated:
                self._ready(eid, ep, now)
            else:
                self._finish(eid, ep, "masked")
                masked.append(eid)
        return masked

    async def form_group(self, now: float) -> list[Member]:
        keyed = self._keyed_group(now)
        if keyed:
            return keyed
        ready = sorted((ep.ready_at, eid) for eid, ep in self._eps.items() if ep.state == "ready" and not ep.group_key)
        size = self.policy.group_size
        if not ready:
            return []
        waited = now - ready[0][0]
        if len(ready) < size and not (self.policy.group_wait_s > 0 and waited >= self.policy.group_wait_s):
            return []
        return self._claim([eid for _, eid in ready[:size]], now)

    def _keyed_group(self, now: float) -> list[Member]:
        """A keyed group that is due (complete, or its oldest ready member has waited
        `group_timeout_s`), the one with the oldest ready member first, claimed; [] when none is."""
        due: list[tuple[float, str]] = []
        for key, group in self._keys.items():
            if not group.ready:
                continue
            first = group.ready[0][0]
            if len(group.ready) + group.gone >= group.want or first <= now - self.policy.group_timeout_s:
                due.append((first, key))
        if not due:
            return []
        key = min(due)[1]
        group = self._keys[key]
        taken, group.ready = group.ready[: group.want], group.ready[group.want :]
        self._counts["groups_by_key"] += 1
        if len(taken) < group.want:
            self._counts["groups_partial"] += 1
        group.gone, group.touched = 0, self.clock()  # the key starts over
        return self._claim([eid for _, eid in taken], now)

    def _claim(self, take: list[str], now: float) -> list[Member]:
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
