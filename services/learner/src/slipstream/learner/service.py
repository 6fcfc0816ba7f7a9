"""The learner service: trains the policy on scored trajectories and hands new weights to the weight-publisher.

    traj.scored.<env> --(durable "learner")--> intake --groups--> trainer --> staged weights (publisher)
                                                 |                   |------> learner.step
                                                 +-- drops: acked at once, counted by reason
                                      trained trajectories: acked when the checkpoint covering them commits

`service.py` only wires the parts: `intake.py` (grouping, admission, drops), `trainer.py` (the
AdamW step, in a worker thread so the intake keeps draining NATS), `handoff.py` (staging for the
publisher), `checkpoint.py` (object-store checkpoints), `resume.py` (where versions continue),
`ledger.py` (trained ids of committed checkpoints, for duplicates), and with `[service]
redis_url` `leadership.py` (the run's leader lease and fencing token) and `claims.py` (ledger
claims and task statistics in Redis).

Acks and checkpoints: a trained trajectory is acked only after the checkpoint covering its step
is committed (at every step that is a multiple of `checkpoint_every`, at stop, and, when
`commit_when_idle_s` is set, after that long without a batch while steps are uncommitted).
Until then its delivery is kept alive with `in_progress()` every ack_wait/3. A learner killed
between two commits therefore loses no trajectory (its uncommitted ones are redelivered and
trained again from the checkpoint's weights) and counts none twice (the checkpoint's ids turn a
redelivery into a `duplicate`).

With a control plane, every step, staged version and commit happens only under a confirmed
lease (README, "The control plane"); while Redis is unreachable training pauses, acks stay held,
and it goes on by itself when Redis is back.

Tracing: each step is a root span `learner.step` with one link per trajectory trained (to the
scored publish that delivered it, in its task's trace); its context is staged with the weights
(`traceparent` in the file's metadata), so the publisher's `weights.publish` is its child.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import msgspec

from slipstream.bus import Bus, Consumer, Delivery, PublishError, connect_bus, consume
from slipstream.bus.tracing import annotate, batch_span, inject
from slipstream.control import Control, ControlClient, ControlUnavailable
from slipstream.engine.source import load_model
from slipstream.learner.checkpoint import Checkpoints
from slipstream.learner.claims import Claims, Committed
from slipstream.learner.config import LearnerConfig
from slipstream.learner.handoff import WeightHandoff
from slipstream.learner.instruments import (
    CHECKPOINT_S,
    CHECKPOINTS,
    DROPPED_METRIC,
    HELD,
    PENDING_GROUPS,
    PUBLISH_ERRORS,
    READY_GROUPS,
    RECEIVED,
    REDELIVERED,
    SETTLE_ERRORS,
    STALENESS,
    STEP_LOSS,
    STEP_REWARD,
    STEP_TIME,
    STEP_VERSION,
)
from slipstream.learner.intake import Drop, Group, Intake, Member
from slipstream.learner.leadership import FENCE_TOKEN_KEY, LEASE_HOLDER_KEY, Leadership, LeadershipLost
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.outcomes import DROPPED, TRAINED, Outcome, OutcomeLog
from slipstream.learner.resume import last_announced, last_published, resume
from slipstream.learner.trainer import StepStats, Trainer
from slipstream.rl import DropReason
from slipstream.runtime.service import BaseService
from slipstream.schemas import LearnerStep, ScoredTrajectory
from slipstream.schemas.subjects import LEARNER_STEP, STREAMS, StreamSpec, consumer
from slipstream.store import ObjectStore, setup_store
from slipstream.telemetry.logs import get_logger

DURABLE = "learner"
NONFINITE = "nonfinite_gradient"
"""Drop reason of the trajectories of a step whose gradient was not finite (the update is skipped)."""
log = get_logger(__name__)


def learner_streams(ack_wait_s: float) -> tuple[StreamSpec, ...]:
    """The subject table, with the `learner` durable's ack_wait replaced when `ack_wait_s` > 0."""
    if ack_wait_s <= 0:
        return STREAMS
    out = []
    for s in STREAMS:
        consumers = tuple(
            msgspec.structs.replace(c, ack_wait_s=ack_wait_s) if c.durable == DURABLE else c for c in s.consumers
        )
        out.append(msgspec.structs.replace(s, consumers=consumers))
    return tuple(out)


async def _quietly(op: str, action: Awaitable[bool]) -> None:
    # A settlement that cannot reach the server is not fatal: the message comes back after ack_wait
    # (and a trained one is then acked as a duplicate).
    try:
        await action
    except Exception as exc:
        SETTLE_ERRORS.add(1, op=op)
        log.warning("settlement failed", op=op, error=repr(exc))


class LearnerService(BaseService):
    name = "learner"

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.section = cfg.learner
        self.bus: Bus | None = None
        self.store: ObjectStore | None = None
        self.consumer: Consumer[ScoredTrajectory] | None = None
        self.trainer: Trainer | None = None
        self.intake: Intake[Delivery[ScoredTrajectory]] | None = None
        self.checkpoints: Checkpoints | None = None
        self.handoff = WeightHandoff(self.section.staging_dir, dtype=self.section.weights_dtype)
        self.ledger = TrainedLedger(self.section.keep_checkpoints)
        self.outcomes = OutcomeLog(self.section.outcomes_path)
        self.control: Control | None = None
        self.leadership: Leadership | None = None
        self.claims: Claims[Delivery[ScoredTrajectory]] = Claims(None, self._ack_members)
        self.step = 0
        self.version = 0
        self.committed_step = 0
        self._held: list[Member[Delivery[ScoredTrajectory]]] = []
        # Taken by the step in progress; handed back if the step never becomes a staged version.
        self._training: list[Member[Delivery[ScoredTrajectory]]] = []
        # A step was trained but could not be confirmed as the leader's: the model no longer matches
        # any staged version, so nothing of this process may be committed any more.
        self._diverged = False
        self._group_ready = asyncio.Event()
        self._intake_stop = asyncio.Event()
        self._ack_wait_s = self.section.ack_wait_s or consumer(DURABLE)[1].ack_wait_s
        self._finished = False

    # -- setup and resume -------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.cfg
        self.bus = await connect_bus(
            cfg.bus, name=f"{self.name}/{cfg.service.replica}", streams=learner_streams(self.section.ack_wait_s)
        )
        await self.bus.ensure_streams()
        self.store = await asyncio.to_thread(setup_store, cfg.store)
        model, tokenizer = await asyncio.to_thread(load_model, cfg.model)
        self.trainer = Trainer(model, self.section, cfg.loss, pad_id=tokenizer.pad_id)
        self.checkpoints = Checkpoints(self.store, cfg.service.run_id, keep=self.section.keep_checkpoints)
        if cfg.service.redis_url:
            # Before the checkpoint is read: a standby waits here, and resumes from what the leader left.
            await self._take_the_lead(cfg.service.redis_url)
        dropped = await self._resume()
        if self.control is not None:
            await self._mark_ledger()
        self.intake = Intake(
            max_staleness=self.section.max_staleness,
            group_timeout_s=self.section.group_timeout_s,
            vocab_size=model.config.vocab_size,
            ledger=self.ledger,
            uniform_tol=self.section.uniform_tol,
        )
        self.intake.restore_counts(dropped)
        self.consumer = await self.bus.consumer(DURABLE, ScoredTrajectory)

    async def _resume(self) -> dict[str, int]:
        """Load the latest checkpoint (if any) and settle the current version; returns the drop counts."""
        assert self.bus is not None and self.store is not None and self.trainer and self.checkpoints
        point = await resume(
            bus=self.bus,
            store=self.store,
            checkpoints=self.checkpoints,
            handoff=self.handoff,
            trainer=self.trainer,
            seed=self.section.seed,
            announce_timeout_s=self.section.announce_timeout_s,
        )
        self.step = self.committed_step = point.step
        self.version = point.version
        for ids in point.chain_ids:
            self.ledger.commit(ids)
        STEP_VERSION.set(self.version)
        log.info(
            "resumed" if point.checkpoint_version >= 0 else "started",
            run_id=self.cfg.service.run_id,
            step=self.step,
            policy_version=self.version,
            checkpoint_version=point.checkpoint_version,
            announced=point.announced,
            published=point.published,
            staged=point.staged,
            ledger=len(self.ledger),
        )
        return point.dropped

    async def _take_the_lead(self, redis_url: str) -> None:
        """Connect the control plane and take the run's leader lease (waiting for it, or failing, per config)."""
        assert self.checkpoints is not None
        cfg = self.cfg
        # No ping first: with lease_wait a learner started while Redis is down waits for it.
        self.control = Control(ControlClient(redis_url, timeout_s=self.section.control_timeout_s), cfg.service.run_id)
        self.claims = Claims(self.control, self._ack_members)
        # Unique per process: a restarted learner is a new holder, so its predecessor's staged versions are fenced.
        holder = f"{cfg.service.replica or self.name}:{secrets.token_hex(3)}"
        self.leadership = Leadership(
            self.control, holder_id=holder, ttl_s=self.section.lease_ttl_s, wait=self.section.lease_wait
        )
        # Tokens keep growing past the checkpoint's even if Redis lost its counter.
        min_token = await asyncio.to_thread(self.checkpoints.fence_token)
        token = await self.leadership.acquire(min_token=min_token)
        log.info("leading the run", run_id=cfg.service.run_id, holder=holder, token=token)

    async def _mark_ledger(self) -> None:
        """Put the retained checkpoints' ids in the shared ledger (crash mid-commit; Redis that lost them)."""
        assert self.control is not None
        waiting = set(self.claims.pending_ids())  # claimed under their own step when Redis lets them
        ids = [tid for tid in self.ledger.ids() if tid not in waiting]
        if not ids:
            return
        try:
            restored = await self.control.ledger.mark(ids, self.committed_step)
        except ControlUnavailable as exc:
            # The local ledger still covers them; the next start (or reclaim) marks them again.
            log.warning("ledger not restored from the checkpoints", ids=len(ids), error=str(exc))
            return
        log.info("ledger restored from the checkpoints", ids=len(ids), restored=restored)

    async def _lead(self, stop: asyncio.Event | None) -> bool:
        """Confirm this learner leads the run; while Redis is away wait (until `stop`; once without it).

        False: not confirmed (stopping, or Redis down with no wait). Raises `LeadershipLost`.
        """
        if self.leadership is None:
            return True
        while True:
            reclaimed = self.leadership.reclaimed
            if await self.leadership.confirm(self._run_unchanged):
                if self.leadership.reclaimed != reclaimed:
                    await self._mark_ledger()  # Redis may have restarted empty
                return True
            if stop is None or stop.is_set():
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def _run_unchanged(self) -> str | None:
        """Why the run moved on without this learner while its lease had lapsed, or None."""
        assert self.checkpoints is not None and self.store is not None
        latest = await asyncio.to_thread(self.checkpoints.latest_step)
        if latest > self.committed_step:
            return f"checkpoint step {latest} was committed by another learner (this one: {self.committed_step})"
        published = await asyncio.to_thread(last_published, self.store, self.cfg.service.run_id)
        if published > self.version:
            return f"version {published} was published by another learner (this one holds {self.version})"
        return None

    def _fence(self) -> dict[str, str] | None:
        if self.leadership is None:
            return None
        return {FENCE_TOKEN_KEY: str(self.leadership.token), LEASE_HOLDER_KEY: self.leadership.holder_id}

    # -- run --------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        assert self.consumer is not None and self.intake is not None
        intake = asyncio.create_task(
            consume(self.consumer, self._on_delivery, stop=self._intake_stop, auto_ack=False), name="learner.intake"
        )
        housekeeping = asyncio.create_task(self._housekeeping(), name="learner.housekeeping")
        ok = False
        try:
            await self._train_loop(stop)
            ok = True
        except LeadershipLost as exc:
            log.error("leader lease lost: stopped without staging or committing anything more", reason=str(exc))
            raise
        finally:
            self._intake_stop.set()
            results = await asyncio.gather(intake, housekeeping, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    log.error("intake task failed", error=repr(r), exc_info=r)
            await self._finish(commit=ok)

    async def _train_loop(self, stop: asyncio.Event) -> None:
        assert self.intake is not None
        section = self.section
        idle_since = time.monotonic()
        while not stop.is_set():
            if section.max_steps and self.step >= section.max_steps:
                log.info("max_steps reached", step=self.step, policy_version=self.version)
                return
            lost = self.leadership.lost_event if self.leadership is not None else asyncio.Event()
            if lost.is_set():
                # Stop at once if another learner took over; otherwise take the lapsed lease back.
                await self._lead(stop)
                continue
            self._group_ready.clear()
            groups, drops = await self._take(stop)
            await self._settle_drops(drops)
            if groups:
                await self._train(groups, stop)
                idle_since = time.monotonic()
                # At multiples of checkpoint_every, so a task source can tell which steps' acks are held.
                if section.checkpoint_every and self.step % section.checkpoint_every == 0:
                    await self._commit(stop)
                continue
            idle = time.monotonic() - idle_since
            if self._held and section.commit_when_idle_s and idle >= section.commit_when_idle_s:
                await self._commit(stop)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_first(self._group_ready, stop, lost), 0.5)

    async def _take(self, stop: asyncio.Event) -> tuple[list[Group[Delivery[ScoredTrajectory]]], list[Drop[Any]]]:
        """The next step's groups, once this learner is confirmed as the leader and the ledger has had its say."""
        assert self.intake is not None
        n = self.section.groups_per_step
        if self.control is None:
            return self.intake.take(n, self.version)
        drops = self.intake.screen_ready(self.version)
        if self.intake.ready_groups < n or not await self._lead(stop):
            return [], drops
        try:
            ids = self.intake.ready_ids()
            counted = await self.control.ledger.counted(ids)
        except ControlUnavailable:
            return [], drops  # not trained unchecked: the next round asks again
        seen = {tid for tid, c in zip(ids, counted, strict=True) if c}
        if seen:
            drops += self.intake.evict(seen, DropReason.DUPLICATE, "counted in the shared ledger")
        groups, more = self.intake.take(n, self.version)
        return groups, drops + more

    async def _train(self, groups: Sequence[Group[Delivery[ScoredTrajectory]]], stop: asyncio.Event) -> None:
        """One step in its `learner.step` span: a new trace linked to every trajectory it trains on."""
        members = [m for g in groups for m in g.members]
        attributes = {
            "slipstream.run_id": self.cfg.service.run_id,
            "slipstream.step": self.step + 1,
            "slipstream.policy_version": self.version + 1,
            "slipstream.n_trajectories": len(members),
            "slipstream.n_groups": len(groups),
        }
        # One link per trajectory, to the delivery that brought it (its scored publish, in its task's trace).
        with batch_span("learner.step", (m.handles[0] for m in members if m.handles), attributes):
            await self._step(groups, members, stop)

    async def _step(
        self,
        groups: Sequence[Group[Delivery[ScoredTrajectory]]],
        members: list[Member[Delivery[ScoredTrajectory]]],
        stop: asyncio.Event,
    ) -> None:
        assert self.trainer is not None and self.intake is not None
        batch = [[m.scored for m in g.members] for g in groups]
        self._training = members
        stats = await asyncio.to_thread(self.trainer.step, batch, self.version)
        if not stats.applied:
            self._training = []
            annotate({"slipstream.outcome": NONFINITE})
            log.error("gradient not finite; step skipped", grad_norm=stats.grad_norm, n_trajectories=len(members))
            await self._settle_drops(self.intake.drop(members, NONFINITE, f"grad_norm {stats.grad_norm}"))
            return
        # The lease may have gone while the step ran: its weights leave only under a confirmed lead.
        if not await self._lead(stop):
            self._diverged = True  # stopping with Redis away: the step is discarded, its trajectories handed back
            annotate({"slipstream.outcome": "not_confirmed_leader"})
            return
        self._training = []
        self.step += 1
        self.version += 1
        self._held.extend(members)
        finished_at = time.time()
        # The step span's context rides in the staged file, so the publication continues this trace.
        trace_context: dict[str, str] = {}
        inject(trace_context)
        await asyncio.to_thread(
            self.handoff.stage,
            self.version,
            self.trainer.model,
            step_finished_at=finished_at,
            fence=self._fence(),
            trace_context=trace_context,
        )
        annotate({"slipstream.outcome": "staged", "slipstream.loss": stats.loss, "slipstream.n_tokens": stats.n_tokens})
        self._observe(stats)
        await self._publish_step(stats, finished_at)

    def _observe(self, stats: StepStats) -> None:
        STEP_TIME.set(stats.time_s)
        STEP_LOSS.set(stats.loss)
        STEP_REWARD.set(stats.reward_mean)
        STEP_VERSION.set(self.version)
        HELD.set(len(self._held))
        for lag, n in stats.staleness.items():
            for _ in range(n):
                STALENESS.observe(float(lag))
        log.info(
            "step",
            step=self.step,
            policy_version=self.version,
            loss=round(stats.loss, 6),
            reward_mean=round(stats.reward_mean, 4),
            accuracy=round(stats.accuracy, 4),
            n_trajectories=stats.n_trajectories,
            n_tokens=stats.n_tokens,
            grad_norm=round(stats.grad_norm, 4),
            time_s=round(stats.time_s, 3),
            staleness=stats.staleness,
            **{k: round(v, 4) for k, v in stats.figures.items() if k in ("ratio_mean", "clip_fraction")},
        )

    async def _publish_step(self, stats: StepStats, finished_at: float) -> None:
        assert self.bus is not None and self.intake is not None
        run_id = self.cfg.service.run_id
        msg = LearnerStep(
            step=self.step,
            policy_version=self.version,
            run_id=run_id,
            loss=stats.loss,
            reward_mean=stats.reward_mean,
            accuracy=stats.accuracy,
            n_trajectories=stats.n_trajectories,
            n_groups=stats.n_groups,
            n_tokens=stats.n_tokens,
            grad_norm=stats.grad_norm,
            step_time_s=stats.time_s,
            staleness=stats.staleness,
            dropped=dict(self.intake.dropped),
            finished_at=finished_at,
        )
        # The version is in the id: after a crash a step number is redone, but never a version.
        try:
            await self.bus.publish(LEARNER_STEP, msg, msg_id=f"{run_id}:step:{self.step}:v{self.version}")
        except PublishError as exc:
            PUBLISH_ERRORS.add(1)
            log.warning("learner.step not published", step=self.step, error=str(exc))

    # -- commit and acks --------------------------------------------------------------------------
    async def _commit(self, stop: asyncio.Event | None) -> None:
        """Checkpoint the current state, then ack (after its ledger claim) every trajectory trained since the last one.

        Only as the confirmed leader: with Redis away it waits (until `stop`; without one it gives
        up and the trajectories stay held, to be handed back or committed later).
        """
        assert self.trainer is not None and self.checkpoints is not None and self.intake is not None
        if self.step == self.committed_step or self._diverged or not await self._lead(stop):
            return
        ids = [m.trajectory_id for m in self._held]
        started = time.perf_counter()
        await asyncio.to_thread(
            self.checkpoints.save,
            step=self.step,
            policy_version=self.version,
            model=self.trainer.model,
            optimizer=self.trainer.optimizer,
            dropped=dict(self.intake.dropped),
            trained_ids=ids,
            fence_token=self.leadership.token if self.leadership is not None else 0,
        )
        CHECKPOINT_S.set(time.perf_counter() - started)
        CHECKPOINTS.add(1)
        self.committed_step = self.step
        self.ledger.commit(ids)
        held, self._held = self._held, []
        self.outcomes.write(
            Outcome(trajectory_id=tid, outcome=TRAINED, step=self.step, policy_version=self.version) for tid in ids
        )
        HELD.set(0)
        await self.claims.committed(Committed(self.step, held))
        log.info(
            "checkpoint committed",
            step=self.step,
            policy_version=self.version,
            acked=len(ids) if not self.claims.pending else 0,
            unclaimed=self.claims.pending,
        )

    async def _ack_members(self, members: Sequence[Member[Delivery[ScoredTrajectory]]]) -> None:
        """Ack committed (and claimed) trajectories, every delivery of each, and forget them."""
        assert self.intake is not None
        for member in members:
            for handle in member.handles:
                await _quietly("ack", handle.ack())
        self.intake.forget([m.trajectory_id for m in members])

    async def _settle_drops(self, drops: Sequence[Drop[Delivery[ScoredTrajectory]]]) -> None:
        if not drops:
            return
        await self.claims.uniform_group(
            [d.scored for d in drops if d.reason == DropReason.UNIFORM_GROUP and d.scored is not None], self.step
        )
        self.outcomes.write(
            Outcome(trajectory_id=d.trajectory_id, outcome=DROPPED, reason=d.reason, step=self.step) for d in drops
        )
        for drop in drops:
            DROPPED_METRIC.add(1, reason=drop.reason)
            if drop.reason == DropReason.MALFORMED:
                log.warning("malformed trajectory dropped", trajectory_id=drop.trajectory_id, detail=drop.detail)
            else:
                log.debug("dropped", trajectory_id=drop.trajectory_id, reason=drop.reason, detail=drop.detail)
            for handle in drop.handles:
                await _quietly("ack", handle.ack())

    async def _on_delivery(self, d: Delivery[ScoredTrajectory]) -> None:
        assert self.intake is not None
        RECEIVED.add(1)
        before = self.intake.redelivered
        drops = self.intake.offer(d.msg, d, self.version, time.monotonic())
        if self.intake.redelivered > before:
            REDELIVERED.add(1)
        if self.intake.ready_groups:
            self._group_ready.set()
        await self._settle_drops(drops)

    async def _housekeeping(self) -> None:
        """Expire incomplete groups, keep held deliveries alive, refresh the gauges."""
        assert self.intake is not None
        heartbeat_s = max(self._ack_wait_s / 3.0, 0.1)
        tick = min(1.0, self.section.group_timeout_s / 4.0, heartbeat_s)
        last_beat = time.monotonic()
        while not self._intake_stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._intake_stop.wait(), tick)
            await self._settle_drops(self.intake.expire(time.monotonic()))
            if time.monotonic() - last_beat >= heartbeat_s:
                last_beat = time.monotonic()
                for handle in list(self.intake.handles()):
                    await _quietly("in_progress", handle.in_progress())
            if self.claims.pending and self.control is not None and self.control.healthy:
                await self.claims.settle()  # committed while Redis was away: claim and ack them now
            READY_GROUPS.set(self.intake.ready_groups)
            PENDING_GROUPS.set(self.intake.pending_groups)

    async def _finish(self, *, commit: bool) -> None:
        """Commit what was trained (unless the run failed), hand back everything else."""
        if self._finished or self.intake is None:
            return
        self._finished = True
        if commit and self._held:
            try:
                await self._commit(None)
            except Exception as exc:
                log.error("final checkpoint failed; trained trajectories handed back", error=repr(exc), exc_info=True)
        released = self.intake.untrained() + self._training
        self.intake.forget([m.trajectory_id for m in self._training])
        self._training = []
        if not await self.claims.settle():
            # Committed, but Redis never took the claims: handed back, the redeliveries are duplicates
            # of the checkpoint (the next start marks its ids in the ledger).
            unclaimed = self.claims.drain()
            released += unclaimed
            self.intake.forget([m.trajectory_id for m in unclaimed])
        if self._held:
            # Never committed: their step is lost, so they must be trained again by the next run.
            released += self._held
            self.intake.forget([m.trajectory_id for m in self._held])
            self._held = []
        for member in released:
            for handle in member.handles:
                await _quietly("release", handle.release())
        log.info("stopped", step=self.step, committed_step=self.committed_step, released=len(released))

    async def drain(self) -> None:
        await self._finish(commit=False)

    async def close(self) -> None:
        if self.leadership is not None:
            await self._hand_over()
            await self.leadership.release()  # a standby takes over at once instead of after the ttl
        if self.control is not None:
            await self.control.close()
        if self.consumer is not None:
            with contextlib.suppress(Exception):  # the bus close below tears it down anyway
                await self.consumer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            self.store.close()

    async def _hand_over(self) -> None:
        """Keep the lease while the publisher announces what was staged (it announces only under a held lease)."""
        assert self.leadership is not None
        if self.bus is None or self.intake is None or not self.leadership.valid():
            return
        deadline = time.monotonic() + self.section.lease_handover_s
        announced = -1
        while time.monotonic() < deadline:
            # Announced, not just stored: the publisher checks the lease once more right before the announce.
            announced = await last_announced(self.bus, self.cfg.service.run_id, 0.5)
            if announced >= self.version:
                return
            await asyncio.sleep(0.1)
        log.warning(
            "lease released before the last staged versions were announced; a successor fences them",
            announced=announced,
            policy_version=self.version,
        )

    # -- probes -----------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected

    def in_flight(self) -> int:
        return self.intake.in_flight if self.intake is not None else 0

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected},
            "step": self.step,
            "policy_version": self.version,
            "committed_step": self.committed_step,
            "held": len(self._held),
        }
        if self.control is not None and self.leadership is not None:
            # Degraded, not unready: the learner pauses safely and recovers by itself (README, "Redis outages").
            out["control"] = self.control.readiness()
            out["lease"] = self.leadership.status()
            out["unclaimed"] = self.claims.pending
        if self.intake is not None:
            out.update(
                ready_groups=self.intake.ready_groups,
                pending_groups=self.intake.pending_groups,
                dropped=dict(self.intake.dropped),
            )
        return out


async def _first(*events: asyncio.Event) -> None:
    """Return as soon as one of `events` is set."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
