"""Trace plumbing in the bus: producer spans inject context, `consume` handles each message in a child span.

Runs on the in-memory bus (no sockets). The OpenTelemetry global provider can be set only once
per process, so each test swaps the API's global for its own provider and puts it back after.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from slipstream.bus import Bus, BusConfig, ConsumeStats, Delivery, connect_bus, consume
from slipstream.bus.tracing import batch_span, message_ids, tracing_active
from slipstream.schemas import ScoredTrajectory, Task, Trajectory

pytestmark = pytest.mark.unit


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "bus-under-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(type="memory", url=f"memory://{uuid.uuid4().hex}", fetch_timeout_s=0.05), name="t")
    await b.ensure_streams()
    yield b
    await b.close()


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", env="arith", prompt=f"{i}+{i}=", reference=str(2 * i), run_id="run-9")


def named(exporter: InMemorySpanExporter) -> dict[str, ReadableSpan]:
    return {s.name: s for s in exporter.get_finished_spans()}


async def run_once(
    bus: Bus, handler_body: Callable[[Delivery[Task]], Awaitable[None]] | None = None
) -> tuple[list[Delivery[Task]], ConsumeStats]:
    """Consume from the rollout-worker durable until one delivery was handled (or failed)."""
    consumer = await bus.consumer("rollout-worker", Task)
    stop = asyncio.Event()
    seen: list[Delivery[Task]] = []

    async def handler(d: Delivery[Task]) -> None:
        seen.append(d)
        stop.set()
        if handler_body is not None:
            await handler_body(d)

    stats = await asyncio.wait_for(consume(consumer, handler, stop=stop, error_delay_s=0.0), 5)
    await consumer.close()
    return seen, stats


async def test_a_handler_runs_in_a_consumer_span_whose_parent_is_the_producer(
    bus: Bus, spans: InMemorySpanExporter
) -> None:
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("source tick"):
        await bus.publish("tasks.arith", task(1), msg_id="task-1")

    async def republish(d: Delivery[Task]) -> None:
        traj = Trajectory(trajectory_id="tr-1", task_id=d.msg.task_id, env="arith", run_id="run-9", worker_id="w-0")
        await bus.publish("traj.raw.arith", traj, msg_id="tr-1")

    seen, stats = await run_once(bus, republish)
    assert stats.handled == 1 and seen[0].settled == "ack"

    got = named(spans)
    tick, produce, process, downstream = (
        got["source tick"],
        got["publish tasks.arith"],
        got["process tasks.arith"],
        got["publish traj.raw.arith"],
    )
    trace_id = tick.context.trace_id
    assert {s.context.trace_id for s in (produce, process, downstream)} == {trace_id}
    assert produce.parent is not None and produce.parent.span_id == tick.context.span_id
    assert process.parent is not None and process.parent.span_id == produce.context.span_id
    assert process.parent.is_remote  # it came through the headers, not the in-process context
    assert downstream.parent is not None and downstream.parent.span_id == process.context.span_id
    assert (produce.kind, process.kind) == (SpanKind.PRODUCER, SpanKind.CONSUMER)
    assert dict(process.attributes or {}) == {
        "messaging.system": "nats",
        "messaging.operation.type": "process",
        "messaging.destination.name": "tasks.arith",
        "messaging.consumer.group.name": "rollout-worker",
        "messaging.nats.stream_sequence": 1,
        "messaging.nats.delivery_count": 1,
        "messaging.message.id": "task-1",
        "slipstream.run_id": "run-9",
        "slipstream.task_id": "t1",
        "slipstream.env": "arith",
    }
    # What the handler published carries the consumer's trace onward in its headers.
    raw = await bus.consumer("reward-model", Trajectory)
    (d,) = await raw.fetch(1, 1.0)
    version, tid, sid, _flags = d.headers["traceparent"].split("-")
    assert (version, tid, sid) == ("00", f"{trace_id:032x}", f"{downstream.context.span_id:016x}")
    await raw.close()


async def test_a_failing_handler_leaves_an_error_span_with_the_exception(bus: Bus, spans: InMemorySpanExporter) -> None:
    await bus.publish("tasks.arith", task(2))

    async def boom(d: Delivery[Task]) -> None:
        raise RuntimeError("verifier exploded")

    seen, stats = await run_once(bus, boom)
    assert stats.failed == 1 and seen[0].settled == "nak"
    process = named(spans)["process tasks.arith"]
    assert process.status.status_code is StatusCode.ERROR
    (event,) = [e for e in process.events if e.name == "exception"]
    assert dict(event.attributes or {})["exception.message"] == "verifier exploded"


async def test_without_a_tracer_provider_no_span_is_made_and_no_context_is_read(bus: Bus) -> None:
    assert not tracing_active()
    await bus.publish("tasks.arith", task(3))
    seen, stats = await run_once(bus)
    assert stats.handled == 1
    (d,) = seen
    assert "traceparent" not in d.headers  # nothing current to propagate
    assert d._context is None  # the loop never extracted the headers


async def test_a_batch_span_links_every_message_it_used(bus: Bus, spans: InMemorySpanExporter) -> None:
    tracer = trace.get_tracer("test")
    for i in range(3):
        with tracer.start_as_current_span(f"origin {i}"):
            await bus.publish("tasks.arith", task(i), msg_id=f"task-{i}")
    consumer = await bus.consumer("rollout-worker", Task)
    deliveries = await consumer.fetch(3, 1.0)
    assert len(deliveries) == 3
    with tracer.start_as_current_span("outer"), batch_span("learner step", deliveries, {"slipstream.step": 7}):
        pass
    await consumer.close()
    got = named(spans)
    step = got["learner step"]
    assert step.parent is None  # a root: the step belongs to no single message's trace
    producers = sorted(
        (s for s in spans.get_finished_spans() if s.name == "publish tasks.arith"), key=lambda s: s.start_time or 0
    )
    assert [(link.context.trace_id, link.context.span_id) for link in step.links] == [
        (p.context.trace_id, p.context.span_id) for p in producers
    ]
    assert [dict(link.attributes or {})["messaging.message.id"] for link in step.links] == [
        "task-0",
        "task-1",
        "task-2",
    ]
    assert dict(step.attributes or {}) == {"messaging.batch.message_count": 3, "slipstream.step": 7}


def test_ids_come_from_the_message_or_the_trajectory_it_wraps() -> None:
    traj = Trajectory(trajectory_id="tr-5", task_id="t5", env="arith", run_id="r", worker_id="w-1", group_id="g-1")
    assert message_ids(ScoredTrajectory(trajectory=traj, reward=1.0)) == {
        "slipstream.trajectory_id": "tr-5",
        "slipstream.task_id": "t5",
        "slipstream.env": "arith",
        "slipstream.run_id": "r",
        "slipstream.worker_id": "w-1",
        "slipstream.group_id": "g-1",
    }
