"""One task's way from delivery to settlement: version gate -> rollout -> publish -> ack.

Every path ends in exactly one settlement, counted by outcome:

- acked: the group was sampled and every episode is stored in TRAJ_RAW;
- nak_version_wait: the engine did not reach `min_policy_version` within the wait budget;
- nak_publish: an episode was not stored (the task comes back with a new group id, so the
  learner never mixes a partial group with its redo);
- nak_error: the rollout failed unexpectedly (logged with its cause);
- released: the worker is shutting down and the drain budget ran out (or the engine stopped);
  the task is handed back at once, without using up a delivery;
- screened: `[worker] screen_target` judged its group very likely uniform (screen.py); acked with
  no group, so the source's window frees at once;
- rejected: the task can never be rolled out here (unknown env, bad split, prompt too long); it
  goes to `dlq.TASKS` with the reason and its original bytes.

An `EngineError` (the engine loop died) is fatal for the process: the task is handed back and
`failed` is set, which ends the service's run with that error.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable
from typing import TypeVar

from slipstream.bus import Bus, Delivery
from slipstream.bus import dlq as dead_letters
from slipstream.bus.tracing import annotate
from slipstream.engine.driver import EngineError
from slipstream.harness import RolloutAborted, TaskRejected
from slipstream.rollout_worker.follower import WeightFollower
from slipstream.rollout_worker.instruments import TASKS, VERSION_WAIT_TIMEOUTS
from slipstream.rollout_worker.outbox import Outbox
from slipstream.rollout_worker.sampler import Sampler
from slipstream.rollout_worker.screen import TaskScreen
from slipstream.schemas import Task
from slipstream.schemas.subjects import dlq_subject, spec_for
from slipstream.telemetry.logs import get_logger

T = TypeVar("T")
log = get_logger(__name__)


class _Aborted(Exception):
    """The drain budget ran out while this step was running."""


class TaskPipeline:
    """The per-task handler the intake runs; see the module docstring for outcomes."""

    def __init__(
        self,
        bus: Bus,
        sampler: Sampler,
        outbox: Outbox,
        follower: WeightFollower,
        *,
        version_wait_timeout_s: float,
        retry_delay_s: float,
        screen: TaskScreen | None = None,
    ) -> None:
        self.bus = bus
        self.screen = screen
        self.sampler = sampler
        self.outbox = outbox
        self.follower = follower
        self.version_wait_timeout_s = version_wait_timeout_s
        self.retry_delay_s = retry_delay_s
        self.abort = asyncio.Event()  # set when the drain budget is spent: hand back unfinished work
        self.failed = asyncio.Event()
        self.fatal: BaseException | None = None
        self.outcomes: Counter[str] = Counter()

    async def handle(self, delivery: Delivery[Task]) -> None:
        task = delivery.msg
        annotate({"slipstream.worker_id": self.sampler.worker_id})
        try:
            self.sampler.env(task.env)
            if not await self._unless_aborted(
                self.sampler.wait_for_version(task.min_policy_version, self.version_wait_timeout_s)
            ):
                VERSION_WAIT_TIMEOUTS.add()
                log.warning(
                    "task handed back: engine below its min_policy_version",
                    task_id=task.task_id,
                    min_policy_version=task.min_policy_version,
                    policy_version=self.sampler.engine.policy_version,
                    waited_s=self.version_wait_timeout_s,
                )
                await self._settle(delivery, "nak_version_wait", delivery.nak(self.retry_delay_s))
                return
            if self.screen is not None and not await self.screen.keep(self.sampler.env(task.env), task):
                await self._settle(delivery, "screened", delivery.ack())
                return
            episodes = await self._unless_aborted(self.sampler.sample(task))
        except (_Aborted, RolloutAborted):
            await self._settle(delivery, "released", delivery.release())
            return
        except TaskRejected as exc:
            await self._reject(delivery, str(exc))
            return
        except EngineError as exc:
            self.fatal = exc
            self.failed.set()
            log.error("engine failed; handing the task back", task_id=task.task_id, error=repr(exc))
            await self._settle(delivery, "released", delivery.release())
            return
        except Exception as exc:
            log.error("rollout failed; nak", task_id=task.task_id, error=repr(exc), exc_info=True)
            await self._settle(delivery, "nak_error", delivery.nak(self.retry_delay_s))
            return
        try:
            await self.outbox.publish(episodes)
        except Exception as exc:  # PublishError or a bus error: the task is redone under a new group id
            log.warning("episode publish failed; nak", task_id=task.task_id, error=repr(exc))
            await self._settle(delivery, "nak_publish", delivery.nak(self.retry_delay_s))
            return
        await self._settle(delivery, "acked", delivery.ack())
        self.follower.note_rollout(episodes)

    async def _unless_aborted(self, step: Awaitable[T]) -> T:
        """Run `step`; if `abort` is set first, cancel it and raise _Aborted."""
        job = asyncio.ensure_future(step)
        if not self.abort.is_set():
            waiter = asyncio.create_task(self.abort.wait())
            try:
                await asyncio.wait({job, waiter}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiter.cancel()
        if not job.done():
            job.cancel()
            await asyncio.gather(job, return_exceptions=True)
            raise _Aborted
        return job.result()

    async def _settle(self, delivery: Delivery[Task], outcome: str, op: Awaitable[bool]) -> None:
        self.outcomes[outcome] += 1
        TASKS.add(outcome=outcome)
        try:
            await op
        except Exception as exc:  # the server will redeliver after ack_wait; nothing is lost
            log.warning("could not settle a task", outcome=outcome, task_id=delivery.msg.task_id, error=repr(exc))

    async def _reject(self, delivery: Delivery[Task], reason: str) -> None:
        """Dead-letter a task no worker of this build can run: original bytes + reason to dlq.TASKS."""
        stream = spec_for(delivery.subject).stream

        def dlq_headers(original: dict[str, str] | None) -> dict[str, str]:
            return dead_letters.dead_letter_headers(
                original,
                kind="schema",
                detail=reason,
                subject=delivery.subject,
                stream=stream,
                consumer="rollout-worker",
                deliveries=delivery.num_delivered,
                sequence=delivery.stream_seq,
            )

        # A task just under the bus limit does not fit beside the DLQ headers: cut, not retried forever.
        body, headers, _ = dead_letters.fit(
            delivery.data, dlq_headers(delivery.headers), dlq_headers(None), self.bus.max_payload
        )
        try:
            await self.bus.publish_raw(dlq_subject(stream), body, headers)
        except Exception as exc:
            log.error("could not dead-letter a task; nak", task_id=delivery.msg.task_id, error=repr(exc))
            await self._settle(delivery, "nak_error", delivery.nak(self.retry_delay_s))
            return
        log.warning("task rejected to the DLQ", task_id=delivery.msg.task_id, reason=reason)
        await self._settle(delivery, "rejected", delivery.term())
