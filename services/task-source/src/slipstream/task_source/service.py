"""The task source: publishes tasks on tasks.<env>, paced by the learner, until the learner reaches max_steps.

    learner.step, weights.announce --> progress (latest version, latest step, held acks)
    stream info of TASKS, TRAJ_RAW, TRAJ_SCORED --> pacing --> n tasks --> tasks.<env>

Every `poll_interval_s` it reads the backlog, and publishes as many tasks as keep the outstanding
groups within the window (see `pacing`), each with min_policy_version = latest − max_staleness.
When the learner reports step `max_steps` it stops publishing and `run` returns (exit 0). One
replica per run: a second one would double the window.

With `[service] redis_url` and `[tasks] skip_min_attempts` > 0, candidates pass the difficulty
filter (`difficulty.py`) first: tasks always or never solved are skipped (counted) and replaced.

With `[tasks] sampler = "pass_rate"` (and Redis), a share of the tasks are revisits of tasks whose
latest group was informative, chosen by their pass rate (`sampler.py`); the rest come fresh.

With tracing on, every task is published inside its own root span `task.publish`: the trace a
task's rollouts, scores and learner step continue.

An announce moves `latest_version` only once the verifier (`slipstream.trust`) has found its
manifest in the store, signed by a trusted key, under a fencing token the lease granted: a forged
version far ahead would otherwise raise min_policy_version above every real version and stall
the run. `/readyz` fails, naming why, when groups are outstanding and the learner has not moved
for `[service] stall_after_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec
from opentelemetry.trace import SpanKind

from slipstream.bus import BusError, connect_bus
from slipstream.bus.tracing import AttributeValue, message_ids, service_span, tracing_active
from slipstream.control import Control, ControlClient, ControlUnavailable
from slipstream.runtime.progress import ProgressWatch
from slipstream.runtime.service import BaseService
from slipstream.schemas import LearnerStep, Task, WeightAnnounce
from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE, spec_for, tasks_subject
from slipstream.store import setup_store
from slipstream.task_source.config import TaskSourceConfig
from slipstream.task_source.difficulty import DifficultyFilter, task_key
from slipstream.task_source.generator import TaskGenerator
from slipstream.task_source.pacing import (
    PACED_STREAMS,
    min_policy_version,
    outstanding_groups,
    tasks_to_publish,
    window,
)
from slipstream.task_source.progress import LearnerProgress
from slipstream.task_source.sampler import PassRateSampler
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge
from slipstream.trust import AnnounceVerifier, Keyring

if TYPE_CHECKING:
    from slipstream.bus import Bus
    from slipstream.store import ObjectStore

M = TypeVar("M", bound=msgspec.Struct)
log = get_logger(__name__)
# Candidates drawn per task to publish when the filter skips some; bounds the work of one look.
DRAWS_PER_TASK = 8
PROBE_INTERVAL_S = 2.0

PUBLISHED = counter("tasks/source/published", "Tasks published (label env).")
OUTSTANDING = gauge("tasks/source/outstanding", "Groups outstanding in the pipeline at the last look.")
WINDOW = gauge("tasks/source/window", "Groups allowed outstanding: groups_per_step × (max_staleness + 1).")
LATEST_VERSION = gauge("tasks/source/latest_version", "Newest policy version known from learner.step or announces.")
LATEST_STEP = gauge("tasks/source/latest_step", "Newest learner step seen.")
ERRORS = counter("tasks/source/errors", "Looks at the backlog or publishes that failed and were retried (label stage).")
REVISITS = counter("tasks/source/revisits", "Tasks the pass-rate sampler served again (label env).")


def task_attributes(task: Task) -> dict[str, AttributeValue]:
    """The `task.publish` span's attributes: the task's ids and what bounds its staleness (empty with tracing off)."""
    if not tracing_active():
        return {}
    return {
        **message_ids(task),
        "slipstream.group_size": task.group_size,
        "slipstream.min_policy_version": task.min_policy_version,
    }


class TaskSourceService(BaseService):
    name = "task-source"

    def __init__(self, cfg: TaskSourceConfig) -> None:
        self.cfg = cfg
        t = cfg.tasks
        self.window = window(t.groups_per_step, t.max_staleness)
        self.progress = LearnerProgress(cfg.service.run_id, checkpoint_every=t.learner_checkpoint_every)
        self.bus: Bus | None = None
        self.generator: TaskGenerator | None = None
        self.published = 0
        self.outstanding = 0.0
        self.control: Control | None = None
        self.filter: DifficultyFilter | None = None
        self.sampler: PassRateSampler | None = None
        # Drawn and admitted, not yet published (a failed publish goes back to the front): sent before new ones.
        self._queue: deque[Task] = deque()
        self._news = asyncio.Event()
        self.store: ObjectStore | None = None
        self.verifier: AnnounceVerifier | None = None
        self.watch = ProgressWatch(cfg.service.stall_after_s)

    async def setup(self) -> None:
        t = self.cfg.tasks
        self.generator = TaskGenerator(
            t.envs,
            env_options=t.env_options,
            split=t.split,
            seed=t.seed,
            group_size=t.group_size,
            run_id=self.cfg.service.run_id,
        )
        keyring = Keyring.parse(self.cfg.trust.trusted_keys)  # BadKey names the entry: fatal
        self.store = await asyncio.to_thread(setup_store, self.cfg.store)
        self.bus = await connect_bus(self.cfg.bus, name=f"{self.name}/{self.cfg.service.replica}")
        await self.bus.ensure_streams()
        WINDOW.set(self.window)
        if self.cfg.service.redis_url and t.skip_min_attempts:
            # No ping: a source started while Redis is down publishes unfiltered until it is back.
            self.control = Control(ControlClient(self.cfg.service.redis_url), self.cfg.service.run_id)
            self.filter = DifficultyFilter(
                self.control,
                min_attempts=t.skip_min_attempts,
                solved_above=t.skip_solved_above,
                solved_below=t.skip_solved_below,
            )
        if self.cfg.service.redis_url and self.control is None:
            # Also the sampler's statistics; without the filter nothing here pings it at start.
            # Only to compare announced fencing tokens with the granted ones; no ping: Redis away = unchecked.
            self.control = Control(ControlClient(self.cfg.service.redis_url), self.cfg.service.run_id)
        if t.sampler == "pass_rate":
            self.sampler = PassRateSampler(
                group_size=t.group_size,
                revisit_share=t.sampler_revisit_share,
                retire_above=t.sampler_retire_above,
                never_weight=t.sampler_never_weight,
                max_serves=t.sampler_max_serves,
                pool_size=t.sampler_pool_size,
                pending_timeout_s=t.sampler_pending_timeout_s,
                seed=t.seed,
            )
        self.verifier = AnnounceVerifier(
            self.store,
            run_id=self.cfg.service.run_id,
            keyring=keyring,
            control=self.control,
            timeout_s=self.cfg.trust.verify_timeout_s,
        )

    async def run(self, stop: asyncio.Event) -> None:
        subjects = (LEARNER_STEP, WEIGHTS_ANNOUNCE)
        synced = [asyncio.Event(), asyncio.Event()]
        followers = [
            asyncio.create_task(self._follow(LEARNER_STEP, LearnerStep, self.progress.on_step, synced[0])),
            asyncio.create_task(
                self._follow(WEIGHTS_ANNOUNCE, WeightAnnounce, self.progress.on_announce, synced[1], self._trusted)
            ),
        ]
        if self.control is not None:
            followers.append(asyncio.create_task(self._probe(stop)))
        try:
            await self._initial_sync(synced, subjects)
            while not stop.is_set() and not self._finished():
                # Cleared before the look, so news arriving during it triggers the next one at once.
                self._news.clear()
                await self._tick(stop)
                if self._finished():
                    break
                # Wake on the poll interval, on stop, or at once when the learner reported progress.
                waiters = [asyncio.create_task(stop.wait()), asyncio.create_task(self._news.wait())]
                await asyncio.wait(waiters, timeout=self.cfg.tasks.poll_interval_s, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
        finally:
            for f in followers:
                f.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
        if self._finished():
            log.info(
                "learner reached max_steps; stopped publishing",
                latest_step=self.progress.latest_step,
                max_steps=self.cfg.tasks.max_steps,
                published=self.published,
                sampler=self.sampler.status() if self.sampler is not None else "off",
            )

    async def _probe(self, stop: asyncio.Event) -> None:
        """Ping Redis now and then, so /readyz shows the control plane's state between filter look-ups."""
        assert self.control is not None
        while not stop.is_set():
            await self.control.ping()  # returns the health flag; failures are counted by the client
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)

    def _finished(self) -> bool:
        return self.progress.finished(self.cfg.tasks.max_steps)

    async def _trusted(self, announce: WeightAnnounce) -> bool:
        """Whether an announce may move the source's version (verified only when it would)."""
        if self.verifier is None or announce.run_id != self.cfg.service.run_id:
            return True  # another run's is ignored by the progress itself
        if announce.policy_version <= self.progress.latest_version:
            return True  # changes nothing: the progress keeps maxima
        return (await self.verifier.verify(announce)).ok

    async def _follow(
        self,
        subject: str,
        cls: type[M],
        take: Callable[[M], bool],
        first: asyncio.Event,
        check: Callable[[M], Awaitable[bool]] | None = None,
    ) -> None:
        """Feed every message of a fan-out subject (the newest stored one first) to `take`, for ever.

        `check` (the announce verifier) may refuse a message first: it is then dropped.

        A subscription that fails is opened again after a pause: without it the source would never
        learn that the run finished. Re-reading the newest message is harmless (`take` keeps maxima).
        """
        assert self.bus is not None
        while True:
            sub = self.bus.subscribe(subject, cls, deliver="last")
            try:
                async for d in sub:
                    first.set()
                    if check is not None and not await check(d.msg):
                        continue
                    if take(d.msg):
                        LATEST_VERSION.set(self.progress.latest_version)
                        LATEST_STEP.set(self.progress.latest_step)
                        self._news.set()
            except Exception as exc:
                ERRORS.add(1, stage="subscribe")
                log.warning("subscription failed; subscribing again", subject=subject, error=repr(exc))
            finally:
                await sub.close()
            await asyncio.sleep(1.0)

    async def _initial_sync(self, synced: list[asyncio.Event], subjects: tuple[str, ...]) -> None:
        """Read the newest learner.step / weights.announce already stored before the first publish.

        Otherwise a restarted source would publish with min_policy_version 0, or publish at all for
        a run that already finished. Skipped for a stream with nothing in it (a fresh run).
        """
        assert self.bus is not None
        for event, subject in zip(synced, subjects, strict=True):
            try:
                info = await self.bus.stream_info(spec_for(subject).stream)
            except Exception as exc:
                # Not fatal: the followers still deliver the newest message, only maybe after a first look.
                ERRORS.add(1, stage="stream_info")
                log.warning("cannot read the stream at start; not waiting for it", subject=subject, error=repr(exc))
                continue
            if int(info.get("messages", 0)) == 0:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), self.cfg.tasks.sync_timeout_s)

    async def _tick(self, stop: asyncio.Event) -> None:
        assert self.bus is not None and self.generator is not None
        t = self.cfg.tasks
        try:
            infos = {name: await self.bus.stream_info(name) for name in PACED_STREAMS}
        except Exception as exc:
            # BusError, or a raw NATS timeout while reconnecting: retried on the next poll.
            ERRORS.add(1, stage="stream_info")
            log.warning("cannot read the backlog; retrying", error=repr(exc))
            return
        held = self.progress.held_trajectories()
        self.outstanding = outstanding_groups(infos, t.group_size, held_trajectories=held)
        OUTSTANDING.set(self.outstanding)
        n = tasks_to_publish(self.outstanding, self.window)
        mpv = min_policy_version(self.progress.latest_version, t.max_staleness)
        if n:
            await self._draw(n, mpv)
        for _ in range(min(n, len(self._queue))):
            if stop.is_set() or self._finished():
                return
            task = self._queue.popleft()
            if task.min_policy_version < mpv:
                task = msgspec.structs.replace(task, min_policy_version=mpv)
            try:
                # Each task starts its own trace; the headers carry it on to rollout, scoring and the learner.
                with service_span("task.publish", task_attributes(task), kind=SpanKind.PRODUCER, root=True):
                    await self.bus.publish(tasks_subject(task.env), task, msg_id=task.task_id)
            except BusError as exc:  # PublishError included
                ERRORS.add(1, stage="publish")
                log.warning("task publish failed; retrying", task_id=task.task_id, error=repr(exc))
                self._queue.appendleft(task)
                return
            self.published += 1
            PUBLISHED.add(1, env=task.env)
        if n:
            log.debug("published", n=n, outstanding=self.outstanding, window=self.window, min_policy_version=mpv)

    async def _draw(self, n: int, mpv: int) -> None:
        """Fill the queue to `n` tasks from the generator, leaving out what the difficulty filter skips."""
        assert self.generator is not None
        if self.sampler is not None:
            await self._revisit(n - len(self._queue), mpv)
        fresh: list[Task] = []
        budget = n * DRAWS_PER_TASK
        while len(self._queue) < n and budget > 0:
            want = min(n - len(self._queue), budget)
            budget -= want
            now = time.time()
            batch = [self.generator.next(min_policy_version=mpv, now=now) for _ in range(want)]
            reasons = await self.filter.reasons(batch) if self.filter is not None else [None] * want
            admitted = [task for task, reason in zip(batch, reasons, strict=True) if reason is None]
            self._queue.extend(admitted)
            fresh.extend(admitted)
        if self.sampler is not None and fresh:
            await self._remember(fresh)

    async def _revisit(self, n: int, mpv: int) -> None:
        """Read the results of the sampler's groups in flight, then queue the revisits it chooses of `n` tasks.

        While Redis is unreachable no result comes in, so nothing is revisited: every task is fresh.
        """
        assert self.sampler is not None and self.control is not None
        now = time.time()
        keys = self.sampler.waiting()
        if keys:
            try:
                stats = await self.control.task_stats.get_many(keys)
            except ControlUnavailable:
                return
            for key, stat in zip(keys, stats, strict=True):
                self.sampler.update(key, stat, now)
        for entry in self.sampler.choose(n):
            task = self.sampler.served(entry, now)
            self._queue.append(msgspec.structs.replace(task, min_policy_version=mpv, created_at=now))
            REVISITS.add(1, env=task.env)

    async def _remember(self, tasks: list[Task]) -> None:
        """Give the sampler the fresh tasks going out, with their statistics now (the base of their group)."""
        assert self.sampler is not None and self.control is not None
        keys = [task_key(t.env, t.metadata, t.task_id) for t in tasks]
        try:
            stats = await self.control.task_stats.get_many(keys)
        except ControlUnavailable:
            return  # not remembered: these go out as plain fresh tasks
        now = time.time()
        for task, key, stat in zip(tasks, keys, stats, strict=True):
            self.sampler.remember(task, key, stat, now)

    async def close(self) -> None:
        if self.control is not None:
            await self.control.close()
        if self.bus is not None:
            await self.bus.close()
        if self.store is not None:
            await asyncio.to_thread(self.store.close)

    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected and self._stall() is None

    def _stall(self) -> str | None:
        """Groups outstanding while the learner stands still (see ProgressWatch), or None."""
        pending = None
        # Before the learner's first step it is starting (loading a model can take minutes), not stuck.
        if self.outstanding > 0 and self.progress.latest_step > 0 and not self._finished():
            pending = (
                f"{self.outstanding:g} group(s) outstanding, learner at step {self.progress.latest_step} "
                f"(version {self.progress.latest_version})"
            )
        return self.watch.observe((self.progress.latest_step, self.progress.latest_version), pending)

    def status(self) -> dict[str, Any]:
        self._stall()
        return {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected},
            "published": self.published,
            "outstanding": round(self.outstanding, 3),
            "window": self.window,
            "latest_version": self.progress.latest_version,
            "latest_step": self.progress.latest_step,
            "finished": self._finished(),
            **self._filter_status(),
            "sampler": self.sampler.status() if self.sampler is not None else "off",
            "announces": self.verifier.status() if self.verifier is not None else {},
            "progress": self.watch.status(),
        }

    def _filter_status(self) -> dict[str, Any]:
        if self.filter is None or self.control is None:
            return {"filter": "off"}
        return {
            "filter": "unfiltered (control plane unreachable)" if self.filter.degraded else "on",
            "skipped": dict(self.filter.skipped),
            "control": self.control.readiness(),
        }
