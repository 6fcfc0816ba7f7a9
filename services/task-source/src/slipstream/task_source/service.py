"""The task source: publishes tasks on tasks.<env>, paced by the learner, until the learner reaches max_steps.

    learner.step, weights.announce --> progress (latest version, latest step, held acks)
    stream info of TASKS, TRAJ_RAW, TRAJ_SCORED --> pacing --> n tasks --> tasks.<env>

Every `poll_interval_s` it reads the backlog, and publishes as many tasks as keep the outstanding
groups within the window (see `pacing`), each with min_policy_version = latest − max_staleness.
When the learner reports step `max_steps` it stops publishing and `run` returns (exit 0). One
replica per run: a second one would double the window.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from slipstream.bus import BusError, connect_bus
from slipstream.runtime.service import BaseService
from slipstream.schemas import LearnerStep, Task, WeightAnnounce
from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE, spec_for, tasks_subject
from slipstream.task_source.config import TaskSourceConfig
from slipstream.task_source.generator import TaskGenerator
from slipstream.task_source.pacing import (
    PACED_STREAMS,
    min_policy_version,
    outstanding_groups,
    tasks_to_publish,
    window,
)
from slipstream.task_source.progress import LearnerProgress
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter, gauge

if TYPE_CHECKING:
    from slipstream.bus import Bus

M = TypeVar("M", bound=msgspec.Struct)
log = get_logger(__name__)

PUBLISHED = counter("tasks/source/published", "Tasks published (label env).")
OUTSTANDING = gauge("tasks/source/outstanding", "Groups outstanding in the pipeline at the last look.")
WINDOW = gauge("tasks/source/window", "Groups allowed outstanding: groups_per_step × (max_staleness + 1).")
LATEST_VERSION = gauge("tasks/source/latest_version", "Newest policy version known from learner.step or announces.")
LATEST_STEP = gauge("tasks/source/latest_step", "Newest learner step seen.")
ERRORS = counter("tasks/source/errors", "Looks at the backlog or publishes that failed and were retried (label stage).")


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
        self._retry: Task | None = None  # a task whose publish failed: sent again before any new one
        self._news = asyncio.Event()

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
        self.bus = await connect_bus(self.cfg.bus, name=f"{self.name}/{self.cfg.service.replica}")
        await self.bus.ensure_streams()
        WINDOW.set(self.window)

    async def run(self, stop: asyncio.Event) -> None:
        subjects = (LEARNER_STEP, WEIGHTS_ANNOUNCE)
        synced = [asyncio.Event(), asyncio.Event()]
        followers = [
            asyncio.create_task(self._follow(LEARNER_STEP, LearnerStep, self.progress.on_step, synced[0])),
            asyncio.create_task(self._follow(WEIGHTS_ANNOUNCE, WeightAnnounce, self.progress.on_announce, synced[1])),
        ]
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
            )

    def _finished(self) -> bool:
        return self.progress.finished(self.cfg.tasks.max_steps)

    async def _follow(self, subject: str, cls: type[M], take: Callable[[M], bool], first: asyncio.Event) -> None:
        """Feed every message of a fan-out subject (the newest stored one first) to `take`, for ever.

        A subscription that fails is opened again after a pause: without it the source would never
        learn that the run finished. Re-reading the newest message is harmless (`take` keeps maxima).
        """
        assert self.bus is not None
        while True:
            sub = self.bus.subscribe(subject, cls, deliver="last")
            try:
                async for d in sub:
                    first.set()
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
        for _ in range(n):
            if stop.is_set() or self._finished():
                return
            if self._retry is not None:
                task = msgspec.structs.replace(self._retry, min_policy_version=max(mpv, self._retry.min_policy_version))
            else:
                task = self.generator.next(min_policy_version=mpv, now=time.time())
            try:
                await self.bus.publish(tasks_subject(task.env), task, msg_id=task.task_id)
            except BusError as exc:  # PublishError included
                ERRORS.add(1, stage="publish")
                log.warning("task publish failed; retrying", task_id=task.task_id, error=repr(exc))
                self._retry = task
                return
            self._retry = None
            self.published += 1
            PUBLISHED.add(1, env=task.env)
        if n:
            log.debug("published", n=n, outstanding=self.outstanding, window=self.window, min_policy_version=mpv)

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()

    def ready(self) -> bool:
        return self.bus is not None and self.bus.connected

    def status(self) -> dict[str, Any]:
        return {
            "bus": {"type": self.cfg.bus.type, "connected": self.bus is not None and self.bus.connected},
            "published": self.published,
            "outstanding": round(self.outstanding, 3),
            "window": self.window,
            "latest_version": self.progress.latest_version,
            "latest_step": self.progress.latest_step,
            "finished": self._finished(),
        }
