"""The source loop: take announcements from the `eval-gate` durable and settle each one exactly once.

    fetch (only while Redis answers) -> verify -> classify -> gate.consider (heartbeats meanwhile) -> ack / nak

Fetching is the bus's one pull loop (`slipstream.bus.pull_loop`: backoff when a fetch fails);
"only while Redis answers" is this intake's `ready` step of it.

- Redis down: nothing is fetched (so no announcement uses up deliveries and reaches the DLQ
  while the control plane is away); Redis is pinged every `retry_delay_s` and fetching resumes
  by itself. An outage in the middle of a judgement naks that announcement with the delay.
- Every announcement of this run is verified first (`slipstream.trust`: manifest present and
  consistent, signed by a trusted key, a fencing token the lease granted). A refused one is acked
  (outcome `refused_<reason>`, counted by the verifier) and never judged; one whose manifest the
  store could not serve in time is handed back for later instead.
- Of several due announcements fetched together, only the newest is evaluated when
  `skip_superseded` (the others are acked and counted): a gate that fell behind catches up
  instead of queueing evaluations of versions nobody will serve.
- An evaluation longer than the consumer's ack wait is kept alive with in-progress signals.
- On stop, what was fetched and not started is released (redelivered at once, to any replica).
- With tracing on, each judgement runs in a CONSUMER span, child of the announce (so of the
  learner step's trace); the eval.result and weights.promoted it publishes continue that trace.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Awaitable
from typing import TYPE_CHECKING

from slipstream.bus.pull_loop import pull_loop
from slipstream.bus.tracing import consumer_span, tracing_active
from slipstream.control import Control, ControlUnavailable
from slipstream.eval_gate.gate import Gate
from slipstream.eval_gate.instruments import RETRIED, SKIPPED
from slipstream.runtime.backoff import sleep_or_stop
from slipstream.schemas import WeightAnnounce
from slipstream.telemetry.logs import get_logger
from slipstream.trust import AnnounceVerifier

if TYPE_CHECKING:
    from slipstream.bus import Consumer, Delivery

log = get_logger(__name__)


class AnnounceIntake:
    """Runs `gate.consider` over the durable consumer until stopped."""

    def __init__(
        self,
        consumer: Consumer[WeightAnnounce],
        gate: Gate,
        control: Control,
        *,
        batch: int,
        fetch_timeout_s: float,
        retry_delay_s: float,
        heartbeat_s: float,
        skip_superseded: bool,
        verifier: AnnounceVerifier | None = None,
    ) -> None:
        self.consumer = consumer
        self.gate = gate
        self.control = control
        self.batch = batch
        self.fetch_timeout_s = fetch_timeout_s
        self.retry_delay_s = retry_delay_s
        self.heartbeat_s = heartbeat_s
        self.skip_superseded = skip_superseded
        self.verifier = verifier
        self.outcomes: Counter[str] = Counter()
        self.in_flight = 0

    async def run(self, stop: asyncio.Event) -> None:
        async def control_up() -> int:
            # While Redis is away nothing is fetched: the announcements wait in the stream.
            if not self.control.healthy and not await self.control.ping():
                await sleep_or_stop(stop, self.retry_delay_s)
                return 0
            return self.batch

        async def take(fetched: list[Delivery[WeightAnnounce]]) -> None:
            await self.handle(fetched, stop)

        await pull_loop(self.consumer, take, stop=stop, fetch_timeout_s=self.fetch_timeout_s, ready=control_up)

    async def handle(self, fetched: list[Delivery[WeightAnnounce]], stop: asyncio.Event) -> None:
        """Settle every delivery of one fetch (see the module docstring for the order)."""
        work = await self._verified(list(fetched))
        if self.skip_superseded:
            work = await self._drop_superseded(work)
        for i, d in enumerate(work):
            if stop.is_set():
                for rest in work[i:]:
                    await self._settle(rest, "released", rest.release())
                return
            await self._one(d)

    async def _verified(self, fetched: list[Delivery[WeightAnnounce]]) -> list[Delivery[WeightAnnounce]]:
        """The deliveries that pass the verifier (other runs pass through: the gate skips them)."""
        if self.verifier is None:
            return fetched
        keep: list[Delivery[WeightAnnounce]] = []
        for d in fetched:
            if d.msg.run_id and d.msg.run_id != self.gate.run_id:
                keep.append(d)
                continue
            verdict = await self.verifier.verify(d.msg)
            if verdict.ok:
                keep.append(d)
            elif verdict.reason == "unfetchable":
                await self._settle(d, "nak_unfetchable", d.nak(self.retry_delay_s))
            else:
                await self._settle(d, f"refused_{verdict.reason}", d.ack())
        return keep

    async def _drop_superseded(self, fetched: list[Delivery[WeightAnnounce]]) -> list[Delivery[WeightAnnounce]]:
        gate = self.gate
        due = [
            d for d in fetched if (not d.msg.run_id or d.msg.run_id == gate.run_id) and gate.due(d.msg.policy_version)
        ]
        if len(due) < 2:
            return fetched
        newest = max(due, key=lambda d: d.msg.policy_version)
        keep: list[Delivery[WeightAnnounce]] = []
        for d in fetched:
            if d in due and d is not newest and d.msg.policy_version < newest.msg.policy_version:
                SKIPPED.add(reason="superseded")
                log.info(
                    "superseded before evaluation",
                    policy_version=d.msg.policy_version,
                    newest=newest.msg.policy_version,
                )
                await self._settle(d, "superseded", d.ack())
            else:
                keep.append(d)
        return keep

    async def _one(self, d: Delivery[WeightAnnounce]) -> None:
        self.in_flight += 1
        beat = asyncio.create_task(self._heartbeat(d))
        try:
            if tracing_active():
                # Our own fetch loop: the consumer span (child of the announce) is opened here.
                with consumer_span(d, self.consumer.durable):
                    outcome = await self.gate.consider(d.msg)
            else:
                outcome = await self.gate.consider(d.msg)
        except ControlUnavailable as exc:
            RETRIED.add(reason="control")
            log.warning(
                "control plane unavailable; announcement handed back", version=d.msg.policy_version, error=str(exc)
            )
            await self._settle(d, "nak_control", d.nak(self.retry_delay_s))
        except asyncio.CancelledError:
            # Shutdown past the drain budget: give it back now rather than after the ack wait.
            with contextlib.suppress(Exception):
                await asyncio.shield(d.release())
            raise
        except Exception as exc:  # store or bus trouble, or a bug: retried, then dead-lettered after max_deliver
            RETRIED.add(reason="error")
            log.error(
                "judging failed; announcement handed back", version=d.msg.policy_version, error=repr(exc), exc_info=True
            )
            await self._settle(d, "nak_error", d.nak(self.retry_delay_s))
        else:
            await self._settle(d, outcome, d.ack())
        finally:
            beat.cancel()
            self.in_flight -= 1

    async def _heartbeat(self, d: Delivery[WeightAnnounce]) -> None:
        while True:
            await asyncio.sleep(self.heartbeat_s)
            try:
                await d.in_progress()
            except Exception as exc:  # the ack wait may lapse and the version be judged twice: harmless
                log.warning("in-progress signal failed", version=d.msg.policy_version, error=repr(exc))

    async def _settle(self, d: Delivery[WeightAnnounce], outcome: str, op: Awaitable[bool]) -> None:
        self.outcomes[outcome] += 1
        try:
            await op
        except Exception as exc:  # redelivered after the ack wait; consider() is idempotent
            log.warning("could not settle an announcement", outcome=outcome, error=repr(exc))
