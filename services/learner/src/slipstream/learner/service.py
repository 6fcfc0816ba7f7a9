"""The learner service: trains the policy on scored trajectories and hands new weights to the weight-publisher.

    traj.scored.<env> --(durable "learner")--> intake --groups--> ranks ---> staged weights (publisher)
                                                 |                   |------> learner.step
                                                 +-- drops: acked at once, counted by reason
                                      trained trajectories: acked when the checkpoint covering them commits

`service.py` only wires the parts: `intake.py` (grouping, admission, drops), `group.py` (the
training ranks as one, whatever `[learner] ranks` says: in this process for one rank, `trainer.py`'s
AdamW step, or FSDP2 rank actors on Ray, `ranks.py`; stepped in a worker thread so the intake keeps
draining NATS), `handoff.py` (each rank's staging for its publisher), `report.py` (the step's
metrics, log line and `learner.step`), `commit.py` (checkpoint commits, acks, drops, and the
hand-back at stop; `checkpoint.py` writes the checkpoints),
`progress.py` (the step counters the parts share), `resume.py` (where versions continue),
`ledger.py` (trained ids of committed checkpoints, for duplicates), `slipstream.trust.scores` (with
`[provenance] trusted_keys`, a scored episode not signed by a trusted reward-model key is refused
before the intake: acked, counted as `untrusted`, never trained), and with `[service]
redis_url` `lead.py` over `leadership.py` (the run's leader lease and fencing token) and
`claims.py` (ledger claims and task statistics in Redis).

Acks and checkpoints (`commit.py`): a trained trajectory is acked only after the checkpoint
covering its step is committed; until then its delivery is kept alive here with `in_progress()`
every ack_wait/3. A learner killed between two commits therefore loses no trajectory and counts
none twice.

With a control plane, every step, staged version and commit happens only under a confirmed
lease (README, "The control plane"); while Redis is unreachable training pauses, acks stay held,
and it goes on by itself when Redis is back.

Tracing: each step is a root span `learner.step` with one link per trajectory trained (to the
scored publish that delivered it, in its task's trace); its context is staged with the weights
(`traceparent` in the file's metadata), so the publisher's `weights.publish` is its child.

Readiness reflects progress: with groups held (complete or waiting for members) and no step for
`[service] stall_after_s`, `/readyz` fails and its status names why (`progress`).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from slipstream.bus import Bus, Consumer, Delivery, connect_bus, consume
from slipstream.bus.tracing import annotate, batch_span, inject
from slipstream.control import Control, ControlClient, ControlUnavailable
from slipstream.learner.checkpoint import Checkpoints
from slipstream.learner.claims import Claims
from slipstream.learner.commit import Committer, Entry, quietly
from slipstream.learner.config import LearnerConfig
from slipstream.learner.group import Ranks, open_ranks
from slipstream.learner.handoff import WeightHandoff
from slipstream.learner.instruments import PENDING_GROUPS, READY_GROUPS, RECEIVED, REDELIVERED, STEP_VERSION
from slipstream.learner.intake import Drop, Group, Intake
from slipstream.learner.lead import Lead, confirmed
from slipstream.learner.leadership import LeadershipLost
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.outcomes import OutcomeLog
from slipstream.learner.progress import Progress
from slipstream.learner.ranks import RankError
from slipstream.learner.report import observe, publish_step
from slipstream.learner.resume import resume
from slipstream.learner.sft_export import SftExport
from slipstream.rl import DropReason
from slipstream.runtime.progress import ProgressWatch
from slipstream.runtime.service import BaseService
from slipstream.schemas import ScoredEpisode
from slipstream.schemas.subjects import STREAMS, StreamSpec, consumer
from slipstream.store import ObjectNotFound, ObjectStore, setup_store
from slipstream.store import episodes as episode_bodies
from slipstream.telemetry.logs import get_logger
from slipstream.trust import Keyring, ScoreVerifier

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


class LearnerService(BaseService):
    name = "learner"

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.section = cfg.learner
        self.bus: Bus | None = None
        self.store: ObjectStore | None = None
        self.consumer: Consumer[ScoredEpisode] | None = None
        self.ranks: Ranks | None = None
        self.intake: Intake[Delivery[ScoredEpisode]] | None = None
        self.checkpoints: Checkpoints | None = None
        self.handoff = WeightHandoff(
            self.section.staging_dir, ranks=self.section.ranks, dtype=self.section.weights_dtype
        )
        self.ledger = TrainedLedger(self.section.keep_checkpoints)
        self.outcomes = OutcomeLog(self.section.outcomes_path)
        self.progress = Progress()
        self.watch = ProgressWatch(cfg.service.stall_after_s)
        self.control: Control | None = None
        self.lead: Lead | None = None
        self.claims: Claims[Delivery[ScoredEpisode]] = Claims(None, self._ack_members)
        self.committer: Committer | None = None
        self.provenance: ScoreVerifier | None = None
        self._group_ready = asyncio.Event()
        self._intake_stop = asyncio.Event()
        self._ack_wait_s = self.section.ack_wait_s or consumer(DURABLE)[1].ack_wait_s

    # Read by the probes and the tests; the parts share (and advance) `progress`.
    @property
    def step(self) -> int:
        return self.progress.step

    @property
    def version(self) -> int:
        return self.progress.version

    @property
    def committed_step(self) -> int:
        return self.progress.committed_step

    # -- setup and resume -------------------------------------------------------------------------
    async def setup(self) -> None:
        cfg = self.cfg
        # BadKey names the entry: fatal before the model loads.
        self.provenance = ScoreVerifier(Keyring.parse(cfg.provenance.trusted_keys))
        self.bus = await connect_bus(
            cfg.bus, name=f"{self.name}/{cfg.service.replica}", streams=learner_streams(self.section.ack_wait_s)
        )
        await self.bus.ensure_streams()
        self.store = await asyncio.to_thread(setup_store, cfg.store)
        # One rank trains in this process; N make it the Ray driver of N rank actors (Ray is imported only then).
        self.ranks = await asyncio.to_thread(open_ranks, cfg.model, self.section, cfg.loss)
        self.checkpoints = Checkpoints(
            self.store, cfg.service.run_id, keep=self.section.keep_checkpoints, scratch_dir=self.section.shared_dir
        )
        if cfg.service.redis_url:
            # Before the checkpoint is read: a standby waits here, and resumes from what the leader left.
            await self._take_the_lead(cfg.service.redis_url)
        dropped = await self._resume()
        if self.lead is not None:
            await self.lead.mark_ledger()
        self.intake = Intake(
            max_staleness=self.section.max_staleness,
            group_timeout_s=self.section.group_timeout_s,
            vocab_size=self.ranks.vocab_size,
            ledger=self.ledger,
            uniform_tol=self.section.uniform_tol,
            reward_schedule=self.section.reward_schedule,
            toggle=self.section.toggle,
        )
        self.committer = Committer(
            progress=self.progress,
            intake=self.intake,
            ranks=self.ranks,
            checkpoints=self.checkpoints,
            ledger=self.ledger,
            outcomes=self.outcomes,
            claims=self.claims,
            lead=self.lead,
            sft=SftExport(self.section.sft_export_path, self.section.sft_export_min_reward),
        )
        self.intake.restore_counts(dropped)
        self.consumer = await self.bus.consumer(DURABLE, ScoredEpisode)

    async def _resume(self) -> dict[str, int]:
        """Load the latest checkpoint (if any) and settle the current version; returns the drop counts."""
        assert self.bus is not None and self.store is not None and self.ranks and self.checkpoints
        point = await resume(
            bus=self.bus,
            store=self.store,
            checkpoints=self.checkpoints,
            handoff=self.handoff,
            ranks=self.ranks,
            seed=self.section.seed,
            announce_timeout_s=self.section.announce_timeout_s,
        )
        p = self.progress
        p.step = p.committed_step = point.step
        p.version = point.version
        for ids in point.chain_ids:
            self.ledger.commit(ids)
        if point.committed is not None:
            meta = point.committed
            restored = await asyncio.to_thread(
                self.outcomes.restore_trained,
                meta.trained_ids,
                meta.trained_sequences,
                step=meta.step,
                policy_version=meta.policy_version,
            )
            if restored:
                log.warning(
                    "outcome lines of the last commit were missing; written now",
                    trajectories=restored,
                    step=meta.step,
                    hint="the previous learner stopped between its checkpoint commit and the log write",
                )
        STEP_VERSION.set(p.version)
        log.info(
            "resumed" if point.checkpoint_version >= 0 else "started",
            run_id=self.cfg.service.run_id,
            step=p.step,
            policy_version=p.version,
            checkpoint_version=point.checkpoint_version,
            announced=point.announced,
            published=point.published,
            staged=point.staged,
            ledger=len(self.ledger),
        )
        return point.dropped

    async def _take_the_lead(self, redis_url: str) -> None:
        """Connect the control plane and take the run's leader lease (waiting for it, or failing, per config)."""
        assert self.checkpoints is not None and self.store is not None
        cfg = self.cfg
        # No ping first: with lease_wait a learner started while Redis is down waits for it.
        self.control = Control(ControlClient(redis_url, timeout_s=self.section.control_timeout_s), cfg.service.run_id)
        self.claims = Claims(self.control, self._ack_members)
        self.lead = await Lead.take(
            self.control,
            # Unique per process: a restarted learner is a new holder, so its predecessor's staged versions are fenced.
            holder_id=f"{cfg.service.replica or self.name}:{secrets.token_hex(3)}",
            ttl_s=self.section.lease_ttl_s,
            wait=self.section.lease_wait,
            claims=self.claims,
            checkpoints=self.checkpoints,
            store=self.store,
            ledger=self.ledger,
            progress=self.progress,
        )

    async def _ack_members(self, members: Sequence[Entry]) -> None:
        # The claims' ack: they exist before the committer (the lease is taken before the checkpoint is read).
        assert self.committer is not None
        await self.committer.ack(members)

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
        except RankError as exc:
            # No in-process recovery: the restarted learner resumes from its checkpoint (README, "A dead rank").
            p = self.progress
            log.error(
                "a training rank failed: exiting for a restart from the last checkpoint",
                reason=str(exc),
                step=p.step,
                committed_step=p.committed_step,
                handed_back=len(self.committer.held) + len(self.committer.training) if self.committer else 0,
            )
            raise
        finally:
            self._intake_stop.set()
            results = await asyncio.gather(intake, housekeeping, return_exceptions=True)
            for r in results:
                if isinstance(r, BaseException):
                    log.error("intake task failed", error=repr(r), exc_info=r)
            await self._finish(commit=ok)

    async def _train_loop(self, stop: asyncio.Event) -> None:
        assert self.committer is not None
        section, committer, p = self.section, self.committer, self.progress
        idle_since = time.monotonic()
        while not stop.is_set():
            if section.max_steps and p.step >= section.max_steps:
                log.info("max_steps reached", step=p.step, policy_version=p.version)
                return
            lost = self.lead.lost_event if self.lead is not None else asyncio.Event()
            if lost.is_set():
                # Stop at once if another learner took over; otherwise take the lapsed lease back.
                await confirmed(self.lead, stop)
                continue
            self._group_ready.clear()
            groups, drops = await self._take(stop)
            await committer.settle_drops(drops)
            if groups:
                await self._train(groups, stop)
                idle_since = time.monotonic()
                # At multiples of checkpoint_every, so a task source can tell which steps' acks are held.
                if section.checkpoint_every and p.step % section.checkpoint_every == 0:
                    await committer.commit(stop)
                continue
            idle = time.monotonic() - idle_since
            if committer.held and section.commit_when_idle_s and idle >= section.commit_when_idle_s:
                await committer.commit(stop)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_first(self._group_ready, stop, lost), 0.5)

    async def _take(self, stop: asyncio.Event) -> tuple[list[Group[Delivery[ScoredEpisode]]], list[Drop[Any]]]:
        """The next step's groups, once this learner is confirmed as the leader and the ledger has had its say."""
        assert self.intake is not None
        n = self.section.groups_per_step
        if self.control is None:
            return self.intake.take(n, self.progress.version, step=self.progress.step)
        drops = self.intake.screen_ready(self.progress.version, step=self.progress.step)
        if self.intake.ready_groups < n or not await confirmed(self.lead, stop):
            return [], drops
        try:
            ids = self.intake.ready_ids()
            counted = await self.control.ledger.counted(ids)
        except ControlUnavailable:
            return [], drops  # not trained unchecked: the next round asks again
        seen = {tid for tid, c in zip(ids, counted, strict=True) if c}
        if seen:
            drops += self.intake.evict(seen, DropReason.DUPLICATE, "counted in the shared ledger")
        groups, more = self.intake.take(n, self.progress.version, step=self.progress.step)
        return groups, drops + more

    async def _train(self, groups: Sequence[Group[Delivery[ScoredEpisode]]], stop: asyncio.Event) -> None:
        """One step in its `learner.step` span: a new trace linked to every trajectory it trains on."""
        members = [m for g in groups for m in g.members]
        attributes: dict[str, str | int] = {
            "slipstream.run_id": self.cfg.service.run_id,
            "slipstream.step": self.progress.step + 1,
            "slipstream.policy_version": self.progress.version + 1,
            "slipstream.n_trajectories": len(members),
            "slipstream.n_groups": len(groups),
        }
        # One link per trajectory, to the delivery that brought it (its scored publish, in its task's trace).
        with batch_span("learner.step", (m.handles[0] for m in members if m.handles), attributes):
            await self._step(groups, members, stop)

    async def _step(
        self, groups: Sequence[Group[Delivery[ScoredEpisode]]], members: list[Entry], stop: asyncio.Event
    ) -> None:
        assert self.ranks is not None and self.intake is not None and self.committer is not None
        assert self.bus is not None
        committer, p = self.committer, self.progress
        batch = [self.intake.trained(g, p.step) for g in groups]  # as scored, less Toggle's budget rule
        committer.training = members
        # λ of the reward schedule at the steps already taken (the intake screened the groups at the same step).
        stats = await asyncio.to_thread(self.ranks.step, batch, p.version, step=p.step)
        if not stats.applied:
            committer.training = []
            annotate({"slipstream.outcome": NONFINITE})
            log.error("gradient not finite; step skipped", grad_norm=stats.grad_norm, n_trajectories=len(members))
            await committer.settle_drops(self.intake.drop(members, NONFINITE, f"grad_norm {stats.grad_norm}"))
            return
        # The lease may have gone while the step ran: its weights leave only under a confirmed lead.
        if not await confirmed(self.lead, stop):
            committer.diverged = True  # stopping with Redis away: the step is discarded, its trajectories handed back
            annotate({"slipstream.outcome": "not_confirmed_leader"})
            return
        committer.training = []
        p.step += 1
        p.version += 1
        committer.held.extend(members)
        finished_at = time.time()
        # The step span's context rides in the staged file, so the publication continues this trace.
        trace_context: dict[str, str] = {}
        inject(trace_context)
        await asyncio.to_thread(
            self.handoff.stage_step,
            p.version,
            self.ranks,
            step_finished_at=finished_at,
            fence=self.lead.fence() if self.lead is not None else None,
            trace_context=trace_context,
        )
        annotate({"slipstream.outcome": "staged", "slipstream.loss": stats.loss, "slipstream.n_tokens": stats.n_tokens})
        observe(stats, p, held=len(committer.held))
        await publish_step(
            self.bus,
            stats,
            p,
            run_id=self.cfg.service.run_id,
            dropped=dict(self.intake.dropped),
            finished_at=finished_at,
        )

    # -- intake and housekeeping ------------------------------------------------------------------
    async def _on_delivery(self, d: Delivery[ScoredEpisode]) -> None:
        assert self.intake is not None and self.committer is not None
        RECEIVED.add(1)
        scored = d.msg
        refused = self.provenance.refusal(scored) if self.provenance is not None else None
        if refused is not None:
            # Checked as published (a stub's sha256 binds its body), before anything else reads it.
            reason, detail = refused
            drop = self.intake.refuse(scored.episode.episode_id, d, f"{reason}: {detail}")
            await self.committer.settle_drops([drop])
            return
        if scored.episode.is_stub() and self.store is not None:
            try:
                scored = await asyncio.to_thread(episode_bodies.load_scored, self.store, scored)
            except (ObjectNotFound, episode_bodies.EpisodeBodyError) as exc:
                # The stub is offered as it is: the intake drops it as malformed, naming the stub.
                log.warning("episode body unusable", episode_id=scored.episode.episode_id, error=str(exc))
        before = self.intake.redelivered
        drops = self.intake.offer(scored, d, self.progress.version, time.monotonic(), step=self.progress.step)
        if self.intake.redelivered > before:
            REDELIVERED.add(1)
        if self.intake.ready_groups:
            self._group_ready.set()
        await self.committer.settle_drops(drops)

    async def _housekeeping(self) -> None:
        """Expire incomplete groups, keep held deliveries alive, refresh the gauges."""
        assert self.intake is not None and self.committer is not None
        heartbeat_s = max(self._ack_wait_s / 3.0, 0.1)
        tick = min(1.0, self.section.group_timeout_s / 4.0, heartbeat_s)
        last_beat = time.monotonic()
        while not self._intake_stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._intake_stop.wait(), tick)
            await self.committer.settle_drops(self.intake.expire(time.monotonic()))
            if time.monotonic() - last_beat >= heartbeat_s:
                last_beat = time.monotonic()
                for handle in list(self.intake.handles()):
                    await quietly("in_progress", handle.in_progress())
            if self.claims.pending and self.control is not None and self.control.healthy:
                await self.claims.settle()  # committed while Redis was away: claim and ack them now
            READY_GROUPS.set(self.intake.ready_groups)
            PENDING_GROUPS.set(self.intake.pending_groups)

    # -- stop -------------------------------------------------------------------------------------
    async def _finish(self, *, commit: bool) -> None:
        """Commit what was trained (unless the run failed), hand back everything else."""
        if self.committer is not None:
            await self.committer.finish(commit=commit)

    async def drain(self) -> None:
        await self._finish(commit=False)

    async def close(self) -> None:
        if self.ranks is not None and self.ranks.failed is not None:
            # A failed rank group first: nothing below needs it, and the close budget is short.
            await asyncio.to_thread(self.ranks.close)
        if self.lead is not None:
            if self.bus is not None and self.intake is not None:
                await self.lead.hand_over(self.bus, self.section.lease_handover_s)
            await self.lead.release()  # a standby takes over at once instead of after the ttl
        if self.control is not None:
            await self.control.close()
        if self.consumer is not None:
            with contextlib.suppress(Exception):  # the bus close below tears it down anyway
                await self.consumer.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            self.store.close()
        if self.ranks is not None:
            await asyncio.to_thread(self.ranks.close)  # the rank actors (and the local Ray); nothing for one rank

    # -- probes -----------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected and self._stall() is None

    def _stall(self) -> str | None:
        """Groups held while no step is taken (see ProgressWatch), or None."""
        pending = None
        if self.intake is not None and (self.intake.ready_groups or self.intake.pending_groups):
            pending = (
                f"{self.intake.ready_groups} group(s) ready and {self.intake.pending_groups} waiting for members "
                f"at step {self.progress.step}"
            )
        return self.watch.observe(self.progress.step, pending)

    def in_flight(self) -> int:
        return self.intake.in_flight if self.intake is not None else 0

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected},
            "step": self.progress.step,
            "policy_version": self.progress.version,
            "committed_step": self.progress.committed_step,
            "held": len(self.committer.held) if self.committer is not None else 0,
        }
        if self.control is not None and self.lead is not None:
            # Degraded, not unready: the learner pauses safely and recovers by itself (README, "Redis outages").
            out["control"] = self.control.readiness()
            out["lease"] = self.lead.leadership.status()
            out["unclaimed"] = self.claims.pending
        if self.intake is not None:
            out.update(
                provenance=self.provenance.status() if self.provenance is not None else {},
                ready_groups=self.intake.ready_groups,
                pending_groups=self.intake.pending_groups,
                dropped=dict(self.intake.dropped),
            )
        self._stall()
        out["progress"] = self.watch.status()
        return out


async def _first(*events: asyncio.Event) -> None:
    """Return as soon as one of `events` is set."""
    waiters = [asyncio.create_task(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
