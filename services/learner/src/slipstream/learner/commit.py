"""The learner's sink: checkpoint commits, the acks they release, drops, and what is handed back at stop.

A trained trajectory is acked only after the checkpoint covering its step is committed (at every
step that is a multiple of `checkpoint_every`, at stop, and, when `commit_when_idle_s` is set,
after that long without a batch while steps are uncommitted) and, with a control plane, after its
ledger claim (`claims.py`). Until then it is held, its delivery kept alive by the service's
heartbeats. A learner killed between two commits therefore loses no trajectory (its uncommitted
ones are redelivered and trained again from the checkpoint's weights) and counts none twice (the
checkpoint's ids turn a redelivery into a `duplicate`). Dropped trajectories are acked at once,
counted by reason. At stop, everything neither acked nor committed is released (handed back), so
the next learner trains it without waiting for ack_wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Sequence
from typing import TypeAlias

from slipstream.bus import Delivery
from slipstream.learner.checkpoint import Checkpoints
from slipstream.learner.claims import Claims, Committed
from slipstream.learner.group import Ranks
from slipstream.learner.instruments import CHECKPOINT_S, CHECKPOINTS, DROPPED_METRIC, HELD, SETTLE_ERRORS
from slipstream.learner.intake import Drop, Intake, Member
from slipstream.learner.lead import Lead, confirmed
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.outcomes import DROPPED, TRAINED, Outcome, OutcomeLog
from slipstream.learner.progress import Progress
from slipstream.learner.sft_export import SftExport
from slipstream.rl import DropReason
from slipstream.schemas import ScoredEpisode
from slipstream.telemetry.logs import get_logger

Entry: TypeAlias = Member[Delivery[ScoredEpisode]]
"""A trajectory the intake let go of, with every delivery of it."""
log = get_logger(__name__)

# A uniform-group streak is reported when it reaches this many trajectories, then at each doubling.
UNIFORM_WARN_FIRST = 64


class UniformStreak:
    """Trajectories dropped as `uniform_group` since the last learner step, and when to say so.

    A run in which every group's rewards are equal (a warm-start too weak for any reward, or only
    auxiliary terms varying and their λ annealed to 0) takes no step at all: the learner drops
    every group and the run waits until its timeout with nothing in the step log. `observe`
    returns the streak's length when it reaches `first` trajectories and at every doubling after
    (64, 128, 256, ...), so the learner's log says so early and then ever more rarely.
    """

    def __init__(self, first: int = UNIFORM_WARN_FIRST) -> None:
        if first < 1:
            raise ValueError(f"first must be >= 1, got {first}")
        self.first = first
        self.step = -1
        self.count = 0
        self._next = first

    def observe(self, step: int, uniform: int) -> int | None:
        """Add `uniform` drops seen at learner `step` (a new step resets the streak); the streak, when due."""
        if step != self.step:
            self.step, self.count, self._next = step, 0, self.first
        self.count += uniform
        if uniform and self.count >= self._next:
            while self._next <= self.count:
                self._next *= 2
            return self.count
        return None


async def quietly(op: str, action: Awaitable[bool]) -> None:
    """Run one settlement (ack, release, heartbeat); a failure is counted and logged, not raised."""
    # A settlement that cannot reach the server is not fatal: the message comes back after ack_wait
    # (and a trained one is then acked as a duplicate).
    try:
        await action
    except Exception as exc:
        SETTLE_ERRORS.add(1, op=op)
        log.warning("settlement failed", op=op, error=repr(exc))


class Committer:
    """Holds trained trajectories until their checkpoint commits, then acks them; settles the rest."""

    def __init__(
        self,
        *,
        progress: Progress,
        intake: Intake[Delivery[ScoredEpisode]],
        ranks: Ranks,
        checkpoints: Checkpoints,
        ledger: TrainedLedger,
        outcomes: OutcomeLog,
        claims: Claims[Delivery[ScoredEpisode]],
        lead: Lead | None,
        sft: SftExport | None = None,
    ) -> None:
        self.progress = progress
        self.intake = intake
        self.ranks = ranks
        self.checkpoints = checkpoints
        self.ledger = ledger
        self.outcomes = outcomes
        self.claims = claims
        self.lead = lead
        self.sft = sft if sft is not None else SftExport(None, 1.0)
        self.held: list[Entry] = []
        """Trained in a staged version, waiting for the checkpoint that covers their step."""
        self.training: list[Entry] = []
        """Taken by the step in progress; handed back if the step never becomes a staged version."""
        self.diverged = False
        """A step was trained but could not be confirmed as the leader's: the model no longer matches
        any staged version, so nothing of this process may be committed any more."""
        self._finished = False
        self._uniform = UniformStreak()

    async def commit(self, stop: asyncio.Event | None) -> None:
        """Checkpoint the current state, then ack (after its ledger claim) every trajectory trained since the last one.

        Only as the confirmed leader: with Redis away it waits (until `stop`; without one it gives
        up and the trajectories stay held, to be handed back or committed later).
        """
        p = self.progress
        if p.step == p.committed_step or self.diverged or not await confirmed(self.lead, stop):
            return
        ids = [m.episode_id for m in self.held]
        sequences = [sorted({h.stream_seq for h in m.handles}) for m in self.held]
        started = time.perf_counter()
        await asyncio.to_thread(
            self.checkpoints.save,
            step=p.step,
            policy_version=p.version,
            model=self.ranks.model,
            optimizer=self.ranks.optimizer,
            sharded=self.ranks.sharded_writer,
            dropped=dict(self.intake.dropped),
            trained_ids=ids,
            trained_sequences=sequences,
            fence_token=self.lead.token if self.lead is not None else 0,
        )
        CHECKPOINT_S.set(time.perf_counter() - started)
        CHECKPOINTS.add(1)
        p.committed_step = p.step
        self.ledger.commit(ids)
        held, self.held = self.held, []
        self.outcomes.write(
            Outcome(trajectory_id=tid, outcome=TRAINED, step=p.step, policy_version=p.version, sequences=seqs)
            for tid, seqs in zip(ids, sequences, strict=True)
        )
        self.sft.write(m.scored for m in held)
        HELD.set(0)
        await self.claims.committed(Committed(p.step, held))
        log.info(
            "checkpoint committed",
            step=p.step,
            policy_version=p.version,
            acked=len(ids) if not self.claims.pending else 0,
            unclaimed=self.claims.pending,
        )

    async def ack(self, members: Sequence[Entry]) -> None:
        """Ack committed (and claimed) trajectories, every delivery of each, and forget them."""
        for member in members:
            for handle in member.handles:
                await quietly("ack", handle.ack())
        self.intake.forget([m.episode_id for m in members])

    async def settle_drops(self, drops: Sequence[Drop[Delivery[ScoredEpisode]]]) -> None:
        """Record, count and ack dropped trajectories (a uniform group's attempts are claimed first)."""
        if not drops:
            return
        p = self.progress  # read as it stands at each use: the intake settles drops while a step runs
        uniform_scored = [d.scored for d in drops if d.reason == DropReason.UNIFORM_GROUP and d.scored is not None]
        await self.claims.uniform_group(uniform_scored, p.step)
        self.sft.write(uniform_scored)  # an all-correct group is never trained, yet is what rejection sampling keeps
        self.outcomes.write(
            Outcome(
                trajectory_id=d.episode_id,
                outcome=DROPPED,
                reason=d.reason,
                step=p.step,
                sequences=sorted({h.stream_seq for h in d.handles}),
            )
            for d in drops
        )
        uniform = sum(1 for d in drops if d.reason == DropReason.UNIFORM_GROUP)
        streak = self._uniform.observe(p.step, uniform)
        if streak is not None:
            log.warning(
                "no learner step: every group's rewards were equal",
                uniform_group_drops=streak,
                step=p.step,
                hint="a warm-start too weak for any reward to differ, or only annealed reward terms varying",
            )
        for drop in drops:
            DROPPED_METRIC.add(1, reason=drop.reason)
            if drop.reason == DropReason.MALFORMED:
                log.warning("malformed trajectory dropped", trajectory_id=drop.episode_id, detail=drop.detail)
            else:
                log.debug("dropped", trajectory_id=drop.episode_id, reason=drop.reason, detail=drop.detail)
            for handle in drop.handles:
                await quietly("ack", handle.ack())

    async def finish(self, *, commit: bool) -> None:
        """Commit what was trained (unless the run failed), hand back everything else; once."""
        if self._finished:
            return
        self._finished = True
        if commit and self.held:
            try:
                await self.commit(None)
            except Exception as exc:
                log.error("final checkpoint failed; trained trajectories handed back", error=repr(exc), exc_info=True)
        released = self.intake.untrained() + self.training
        self.intake.forget([m.episode_id for m in self.training])
        self.training = []
        if not await self.claims.settle():
            # Committed, but Redis never took the claims: handed back, the redeliveries are duplicates
            # of the checkpoint (the next start marks its ids in the ledger).
            unclaimed = self.claims.drain()
            released += unclaimed
            self.intake.forget([m.episode_id for m in unclaimed])
        if self.held:
            # Never committed: their step is lost, so they must be trained again by the next run.
            released += self.held
            self.intake.forget([m.episode_id for m in self.held])
            self.held = []
        for member in released:
            for handle in member.handles:
                await quietly("release", handle.release())
        p = self.progress
        log.info("stopped", step=p.step, committed_step=p.committed_step, released=len(released))
