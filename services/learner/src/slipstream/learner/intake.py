"""The learner's intake: scored episodes in, complete and valid groups out, every drop counted.

Episodes arrive one by one (a v1 trajectory as a one-sample episode), in any order, from any
number of reward-model replicas. The intake checks each one (`inspect`), groups them by
`group_id` (one sampling of a task) until the group holds `group_size` arrivals, and queues the
complete groups for the trainer. What cannot be trained on is dropped at once with a
`DropReason` (plus `heldout`: held-out episodes are for evaluation, never for training) and
handed back to the caller to ack:

- duplicate: its id is in a committed checkpoint (the ledger); a redelivery of an episode this
  process still holds is not a drop: the new delivery joins the held one and is settled with it;
- malformed: bad packed arrays in any sample, segments that do not cover the tokens after the
  prompt, a branch from no earlier sample, trainable token ids outside the vocabulary, a
  non-finite reward, a policy version ahead of the learner;
- infra_error: an infrastructure failure spoiled the episode (never the model's fault);
- unscorable: the reward-model could not compute part of its reward (`ScoredEpisode.unscorable`,
  e.g. a judge that gave no usable verdict): its reward is not a score, so it is not trained on
  and its group's baseline is formed by the others;
- no_trained_tokens, heldout, stale (the oldest version over trainable samples, checked at
  arrival and again when the trainer takes the group);
- uniform_group: every remaining member got the same reward (no advantage signal) — the reward
  the step would train on, re-weighted by `[learner] reward_schedule` at the learner step (a group
  whose members differ only in a component annealed to 0 carries no signal any more);
- incomplete_group: the group was not full `group_timeout_s` after its first member (late
  members of such a group are dropped the same way);
- untrusted: the caller found its score unsigned or not signed by a trusted reward-model key
  (`refuse`): it never joins, completes or expires a group, so a forgery cannot shape one.

With `[learner] toggle` enabled, Kimi K2.5's budget rule (`slipstream.rl.toggle`) applies at the
same points: in a budget phase a correct answer over its task's frozen budget counts reward 0 in
the uniform screen and in the episodes `trained` hands the step (the scored episodes are unchanged).

A member dropped on its own still counts as an arrival of its group, so the rest of the group
completes and trains against the survivors' baseline. Nothing here does I/O: the caller passes an
opaque delivery handle with each episode and settles the handles of the `Drop`s it gets back.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import msgspec

from slipstream.rl import DropReason, is_stale, is_uniform_group
from slipstream.rl.schedule import ComponentSchedule, reweighted, weights_at
from slipstream.rl.toggle import Budgets, ToggleConfig, toggle_rewards
from slipstream.schemas import Sample, ScoredEpisode

H = TypeVar("H")
HELDOUT = "heldout"
"""Drop reason of a held-out episode (eval data that reached the training stream)."""
TRAIN_SPLIT = "train"
# Group keys of expired groups remembered so their late members are dropped, not regrouped.
EXPIRED_MEMORY = 65536


@dataclass(frozen=True)
class Inspection:
    """What `inspect` found: a problem ("" when none), the oldest version and the trained-token count."""

    problem: str
    oldest_version: int = -1
    trained_tokens: int = 0


def _inspect_sample(s: Sample, vocab_size: int) -> str:
    """The first problem of one sample's packed arrays ("" when none)."""
    where = f"sample {s.sample_id!r}"
    if len(s.token_ids) % 4 or len(s.logprobs) % 4:
        return f"{where}: token_ids ({len(s.token_ids)} B) or logprobs ({len(s.logprobs)} B) not a multiple of 4"
    n_total = len(s.token_ids) // 4
    completion = n_total - s.prompt_len
    if s.prompt_len < 1 or completion < 1:
        return f"{where}: prompt_len {s.prompt_len} leaves no prompt or nothing after it in {n_total} tokens"
    if len(s.logprobs) // 4 != completion:
        return f"{where}: {len(s.logprobs) // 4} logprobs for {completion} tokens after the prompt"
    if len(s.loss_mask) != completion:
        return f"{where}: {len(s.loss_mask)} loss_mask entries for {completion} tokens after the prompt"
    mask = s.mask()
    if any(m > 1 for m in mask):
        return f"{where}: loss_mask entries must be 0 or 1"
    if not s.segments:
        return f"{where}: no policy segments"
    if any(seg.n_tokens < 1 or seg.policy_version < 0 for seg in s.segments):
        return f"{where}: a policy segment has n_tokens < 1 or a negative policy_version"
    covered = sum(seg.n_tokens for seg in s.segments)
    if covered != completion:
        return f"{where}: segments cover {covered} tokens, {completion} follow the prompt"
    if s.routes and (s.routes_per_token < 1 or len(s.routes) % s.routes_per_token):
        return f"{where}: {len(s.routes)} route bytes are not whole tokens of routes_per_token {s.routes_per_token}"
    if s.routes and len(s.routes) // s.routes_per_token > n_total:
        return f"{where}: routes for {len(s.routes) // s.routes_per_token} tokens, the sample has {n_total}"
    if s.trainable:  # a frozen agent may speak another model's vocabulary; its tokens are never trained
        ids = s.ids()
        if min(ids) < 0 or max(ids) >= vocab_size:
            return f"{where}: token ids span [{min(ids)}, {max(ids)}], outside the vocabulary of {vocab_size}"
        behaviour = s.behaviour_logprobs()
        if not all(math.isfinite(lp) for lp, m in zip(behaviour, mask, strict=True) if m):
            return f"{where}: a trained token's behaviour log-prob is not finite"
    return ""


def inspect(scored: ScoredEpisode, vocab_size: int) -> Inspection:
    """Check one scored episode's wire fields for consistency; names the first problem found.

    The oldest version and the trained-token count are over trainable samples only: a frozen
    sub-agent pinned to an old version does not make its episode stale.
    """
    ep = scored.episode
    if not ep.episode_id:
        return Inspection("empty episode_id")
    if ep.is_stub():
        return Inspection("a by-reference stub reached the intake without its body")
    if not math.isfinite(scored.reward):
        return Inspection(f"reward {scored.reward} is not finite")
    if ep.group_size < 1:
        return Inspection(f"group_size must be >= 1, got {ep.group_size}")
    if not ep.samples:
        return Inspection("no samples")
    seen: set[str] = set()
    for s in ep.samples:
        if s.sample_id in seen:
            return Inspection(f"sample id {s.sample_id!r} appears twice")
        if s.branch_of and s.branch_of not in seen:
            return Inspection(f"sample {s.sample_id!r} branches from {s.branch_of!r}, not an earlier sample")
        seen.add(s.sample_id)
        problem = _inspect_sample(s, vocab_size)
        if problem:
            return Inspection(problem)
    trained = sum(s.n_sampled() for s in ep.samples if s.trainable)
    return Inspection("", oldest_version=ep.oldest_version(), trained_tokens=trained)


@dataclass
class Member(Generic[H]):
    """One admitted episode and every delivery of it still to be settled."""

    scored: ScoredEpisode
    handles: list[H]
    oldest_version: int
    trained_tokens: int

    @property
    def episode_id(self) -> str:
        return self.scored.episode.episode_id

    @property
    def reward(self) -> float:
        """The reward as scored (see `trained_reward` for what a step trains on)."""
        return self.scored.reward

    def trained_reward(self, weights: Mapping[str, float]) -> float:
        """The reward re-weighted by the schedule's λ at a step (`slipstream.rl.schedule.reweighted`)."""
        return reweighted(self.scored.reward, self.scored.components, weights)


@dataclass
class Group(Generic[H]):
    """Trajectories of one sampling of a task (one `group_id`)."""

    key: str
    size: int
    first_seen: float
    members: list[Member[H]] = field(default_factory=list)
    arrived: int = 0


@dataclass(frozen=True)
class Drop(Generic[H]):
    """An episode that will not be trained on: ack its handles, count `reason`."""

    episode_id: str
    reason: str
    handles: tuple[H, ...]
    detail: str = ""
    scored: ScoredEpisode | None = None
    """The episode, when it was admitted before being dropped (its reward counts in task statistics)."""


class Intake(Generic[H]):
    """Grouping and admission; see the module docstring. Not thread-safe: one event loop drives it."""

    def __init__(
        self,
        *,
        max_staleness: int,
        group_timeout_s: float,
        vocab_size: int,
        ledger: Container[str],
        uniform_tol: float = 0.0,
        reward_schedule: Mapping[str, ComponentSchedule] | None = None,
        toggle: ToggleConfig | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.max_staleness = max_staleness
        self.group_timeout_s = group_timeout_s
        self.vocab_size = vocab_size
        self.uniform_tol = uniform_tol
        self.reward_schedule = dict(reward_schedule or {})
        self.toggle = toggle if toggle is not None and toggle.enabled else None
        self.budgets = Budgets(toggle.rho if toggle is not None else 50.0)
        """Toggle's frozen budgets by task key, held in memory (see the learner README)."""
        self.toggled = 0
        """Answers whose reward Toggle set to 0 in the groups handed to the trainer."""
        self._ledger = ledger
        self._pending: dict[str, Group[H]] = {}
        self._ready: deque[Group[H]] = deque()
        self._inflight: dict[str, Member[H]] = {}
        self._expired: OrderedDict[str, None] = OrderedDict()
        self.dropped: dict[str, int] = {}
        self.received = 0
        self.redelivered = 0

    # -- state ------------------------------------------------------------------------------------
    @property
    def ready_groups(self) -> int:
        return len(self._ready)

    @property
    def pending_groups(self) -> int:
        return len(self._pending)

    @property
    def in_flight(self) -> int:
        """Trajectories held and not yet settled (pending, ready, or trained awaiting their commit)."""
        return len(self._inflight)

    def handles(self) -> Iterator[H]:
        """Every unsettled delivery handle (for ack-wait heartbeats)."""
        for member in self._inflight.values():
            yield from member.handles

    # -- arrival ----------------------------------------------------------------------------------
    def offer(self, scored: ScoredEpisode, handle: H, version: int, now: float, *, step: int = 0) -> list[Drop[H]]:
        """Take one delivery; returns the drops it caused (possibly a whole uniform group).

        `step` is the learner's step count (the step the group would train at if taken now): the
        rewards of a group it completes are screened as that step would weigh them.
        """
        self.received += 1
        t = scored.episode
        held = self._inflight.get(t.episode_id) if t.episode_id else None
        if held is not None:
            # Redelivered while we hold it (its ack-wait ran out): settle both deliveries together.
            held.handles.append(handle)
            self.redelivered += 1
            return []
        if t.episode_id in self._ledger:
            return [self._drop_handle(t.episode_id, handle, DropReason.DUPLICATE, "trained in a committed step")]
        key = t.group_id or t.task_id
        if key in self._expired:
            return [self._drop_handle(t.episode_id, handle, DropReason.INCOMPLETE_GROUP, "its group expired")]
        found = inspect(scored, self.vocab_size)
        reason, detail = self._admission(scored, found, version)
        group = self._pending.get(key)
        if not reason and group is not None and t.group_size != group.size:
            reason, detail = DropReason.MALFORMED, f"group_size {t.group_size} differs from its group's {group.size}"
        if group is None and t.group_size >= 1:
            group = self._pending[key] = Group(key=key, size=t.group_size, first_seen=now)
        drops: list[Drop[H]] = []
        if reason:
            drops.append(self._drop_handle(t.episode_id, handle, reason, detail))
        else:
            assert group is not None
            member = Member(scored, [handle], found.oldest_version, found.trained_tokens)
            group.members.append(member)
            self._inflight[member.episode_id] = member
        if group is not None:
            group.arrived += 1
            if group.arrived >= group.size:
                drops.extend(self._complete(group, version, step))
        return drops

    def refuse(self, episode_id: str, handle: H, detail: str) -> Drop[H]:
        """Drop a delivery whose score failed its signature check, before it touches any group (counted)."""
        self.received += 1
        return self._drop_handle(episode_id, handle, DropReason.UNTRUSTED, detail)

    def _admission(self, scored: ScoredEpisode, found: Inspection, version: int) -> tuple[str, str]:
        if found.problem:
            return DropReason.MALFORMED, found.problem
        if scored.episode.infra_error:
            return DropReason.INFRA_ERROR, scored.episode.infra_error
        if scored.unscorable:
            return DropReason.UNSCORABLE, scored.unscorable
        if found.oldest_version > version:
            return DropReason.MALFORMED, f"sampled by version {found.oldest_version}, ahead of the learner's {version}"
        split = scored.episode.split
        if split != TRAIN_SPLIT:
            return HELDOUT, f"split {split!r} is not trained on"
        if found.trained_tokens == 0:
            return DropReason.NO_TRAINED_TOKENS, "loss mask is all zeros"
        if is_stale(found.oldest_version, version, self.max_staleness):
            return DropReason.STALE, f"{version - found.oldest_version} versions behind, max {self.max_staleness}"
        return "", ""

    def _complete(self, group: Group[H], version: int, step: int) -> list[Drop[H]]:
        del self._pending[group.key]
        drops = self._screen(group, version, step)
        if group.members:
            self._ready.append(group)
        return drops

    # -- time and the trainer ---------------------------------------------------------------------
    def expire(self, now: float) -> list[Drop[H]]:
        """Drop every group still incomplete `group_timeout_s` after its first member."""
        drops: list[Drop[H]] = []
        for key in [k for k, g in self._pending.items() if now - g.first_seen > self.group_timeout_s]:
            group = self._pending.pop(key)
            self._expired[key] = None
            if len(self._expired) > EXPIRED_MEMORY:
                self._expired.popitem(last=False)
            detail = f"{group.arrived} of {group.size} arrived within {self.group_timeout_s:g}s"
            drops.extend(self._drop_member(m, DropReason.INCOMPLETE_GROUP, detail) for m in group.members)
        return drops

    def take(self, n: int, version: int, *, step: int = 0) -> tuple[list[Group[H]], list[Drop[H]]]:
        """`n` complete groups to train on at `version` and learner `step`, oldest first, or none if fewer are valid.

        Every queued group is re-checked first: members that went stale since they arrived are
        dropped, and a group left with uniform rewards at `step`'s weights (or no members) goes with them.
        """
        drops = self.screen_ready(version, step=step)
        if len(self._ready) < n:
            return [], drops
        return [self._ready.popleft() for _ in range(n)], drops

    def screen_ready(self, version: int, *, step: int = 0) -> list[Drop[H]]:
        """Drop what is no longer trainable at `version` and learner `step` from the queue, taking nothing."""
        drops: list[Drop[H]] = []
        kept: deque[Group[H]] = deque()
        for group in self._ready:
            drops.extend(self._screen(group, version, step))
            if group.members:
                kept.append(group)
        self._ready = kept
        return drops

    def _screen(self, group: Group[H], version: int, step: int) -> list[Drop[H]]:
        drops: list[Drop[H]] = []
        keep: list[Member[H]] = []
        for m in group.members:
            if is_stale(m.oldest_version, version, self.max_staleness):
                lag = version - m.oldest_version
                drops.append(self._drop_member(m, DropReason.STALE, f"{lag} versions behind, max {self.max_staleness}"))
            else:
                keep.append(m)
        weights = weights_at(self.reward_schedule, step)
        if keep and is_uniform_group(self._toggled(keep, group_rewards(keep, weights), step), self.uniform_tol):
            detail = f"equal rewards at step {step}'s reward weights {weights}" if weights else "equal rewards"
            drops.extend(self._drop_member(m, DropReason.UNIFORM_GROUP, detail) for m in keep)
            keep = []
        group.members = keep
        return drops

    def _toggled(self, members: Sequence[Member[H]], rewards: list[float], step: int) -> list[float]:
        """`rewards` after Toggle's budget rule at `step` (as they are without Toggle)."""
        if self.toggle is None or not members:
            return rewards
        correct = [m.scored.correct for m in members]
        lengths = [m.trained_tokens for m in members]
        budget = self.budgets.measure(toggle_key(members[0].scored), correct, lengths)
        phase = self.toggle.budget_phase(step)
        return toggle_rewards(
            rewards, correct, lengths, budget=budget, accuracy=self.toggle.accuracy, budget_phase=phase
        )

    def trained(self, group: Group[H], step: int) -> list[ScoredEpisode]:
        """The episodes of a taken group as learner `step` trains them: an answer Toggle's budget
        phase zeroes gets reward 0 and every component 0 (the rest as scored)."""
        episodes = [m.scored for m in group.members]
        if self.toggle is None:
            return episodes
        as_scored = [s.reward for s in episodes]
        kept = self._toggled(group.members, as_scored, step)
        out: list[ScoredEpisode] = []
        for s, before, after in zip(episodes, as_scored, kept, strict=True):
            if after == before:
                out.append(s)
            else:
                self.toggled += 1
                zeroed = {name: 0.0 for name in s.components}
                out.append(msgspec.structs.replace(s, reward=after, components=zeroed))
        return out

    def ready_ids(self) -> list[str]:
        """Ids of the members of every queued (complete) group, for a check before they are taken."""
        return [m.episode_id for g in self._ready for m in g.members]

    def evict(self, episode_ids: Container[str], reason: str, detail: str) -> list[Drop[H]]:
        """Drop these members from their groups (queued or pending), e.g. ids the shared ledger already counted.

        A pending group keeps counting them as arrivals, so it still completes; a queued group left
        uniform or empty goes at the next `take`/`screen_ready`.
        """
        drops: list[Drop[H]] = []
        for group in [*self._pending.values(), *self._ready]:
            gone = [m for m in group.members if m.episode_id in episode_ids]
            if gone:
                group.members = [m for m in group.members if m.episode_id not in episode_ids]
                drops.extend(self._drop_member(m, reason, detail) for m in gone)
        return drops

    def drop(self, members: Sequence[Member[H]], reason: str, detail: str) -> list[Drop[H]]:
        """Drop members the trainer could not use (a step whose gradient was not finite)."""
        return [self._drop_member(m, reason, detail) for m in members]

    def forget(self, episode_ids: Sequence[str]) -> None:
        """These episodes were settled by the caller (acked after their commit, or released)."""
        for tid in episode_ids:
            self._inflight.pop(tid, None)

    def untrained(self) -> list[Member[H]]:
        """Remove and return every member not yet taken by the trainer (to hand back on stop)."""
        members = [m for g in self._pending.values() for m in g.members]
        members += [m for g in self._ready for m in g.members]
        self._pending.clear()
        self._ready.clear()
        self.forget([m.episode_id for m in members])
        return members

    def restore_counts(self, dropped: dict[str, int]) -> None:
        """Cumulative drop counts from a checkpoint (a resumed run keeps counting from there)."""
        self.dropped = dict(dropped)

    # -- drops --------------------------------------------------------------------------------------
    def _count(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def _drop_handle(self, tid: str, handle: H, reason: str, detail: str) -> Drop[H]:
        self._count(reason)
        return Drop(tid, str(reason), (handle,), detail)

    def _drop_member(self, member: Member[H], reason: str, detail: str) -> Drop[H]:
        self._inflight.pop(member.episode_id, None)
        self._count(reason)
        return Drop(member.episode_id, str(reason), tuple(member.handles), detail, member.scored)


def toggle_key(scored: ScoredEpisode) -> str:
    """The task a Toggle budget belongs to: `<env>/<problem key>`, else `<env>/<task id>` (the key of
    the per-task statistics, `claims.task_key`, which imports this module and so cannot be imported here)."""
    t = scored.episode
    return f"{t.env}/{t.metadata.get('key', '') or t.task_id}"


def group_rewards(members: Sequence[Member[H]], weights: Mapping[str, float] | None = None) -> list[float]:
    """The rewards the members would train with under `weights` (λ per component; none = as scored)."""
    return [m.trained_reward(weights or {}) for m in members]
