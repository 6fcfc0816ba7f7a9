"""The services' own spans, on the in-memory bus: the rollout-worker's task path, weights.apply,
the learner-to-publisher hand-off of the step's trace context, and the provider's link limit.

The OpenTelemetry global provider can be set only once per process, so tests swap the API's
global for their own provider (or for none) and put it back after, as test_bus_tracing does.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from slipstream.bus import Bus, BusConfig, connect_bus
from slipstream.bus.tracing import extract, inject, tracing_active
from slipstream.eval_gate.intake import AnnounceIntake
from slipstream.learner.handoff import WeightHandoff
from slipstream.rollout_worker.follower import WeightFollower
from slipstream.rollout_worker.intake import TaskIntake
from slipstream.rollout_worker.outbox import Outbox
from slipstream.rollout_worker.pipeline import TaskPipeline
from slipstream.rollout_worker.sampler import Sampler
from slipstream.schemas import (
    Episode,
    PolicySegment,
    Task,
    Timings,
    Trajectory,
    Turn,
    WeightAnnounce,
    episode_from_trajectory,
)
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.store import setup_store
from slipstream.store.config import StoreConfig
from slipstream.telemetry.tracing import MAX_LINKS, span_limits
from slipstream.weight_publisher.codec import VersionStore
from slipstream.weight_publisher.publisher import VersionPublisher
from slipstream.weights.staging import list_staged

pytestmark = pytest.mark.unit
GROUP = 3
STARTED, FINISHED = 1_700_000_000.25, 1_700_000_001.75


@pytest.fixture
def spans(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "under-test"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    yield exporter
    provider.shutdown()


@pytest.fixture
def tracer_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every `trace.get_tracer` call: each span the code makes starts with one."""
    calls: list[str] = []
    real = trace.get_tracer

    def counting(name: str, *args: Any, **kwargs: Any) -> trace.Tracer:
        calls.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(trace, "get_tracer", counting)
    return calls


@pytest.fixture
async def bus() -> AsyncIterator[Bus]:
    b = await connect_bus(BusConfig(type="memory", url=f"memory://{uuid.uuid4().hex}", fetch_timeout_s=0.05), name="t")
    await b.ensure_streams()
    yield b
    await b.close()


class StubSampler:
    """The sampler's surface the pipeline uses, returning a fixed group (two versions per completion)."""

    worker_id = "rollout-worker/w-7"

    def __init__(self) -> None:
        self.engine = type("E", (), {"policy_version": 1})()

    def env(self, name: str) -> None:
        return None

    async def wait_for_version(self, version: int, timeout_s: float) -> bool:
        return True

    async def sample(self, task: Task) -> list[Episode]:
        return [
            episode_from_trajectory(
                Trajectory(
                    trajectory_id=f"{task.task_id}/g/{i}",
                    task_id=task.task_id,
                    env=task.env,
                    run_id=task.run_id,
                    group_index=i,
                    group_size=GROUP,
                    group_id=f"{task.task_id}/g",
                    worker_id=self.worker_id,
                    segments=[PolicySegment(0, 3), PolicySegment(1, 2)],
                    turns=[Turn(role="policy", start=0, end=5)],
                    finish_reason="stop",
                    timings=Timings(started_at=STARTED, finished_at=FINISHED),
                )
            )
            for i in range(GROUP)
        ]


class StubFollower:
    def note_rollout(self, episodes: list[Episode]) -> None:
        return None


def attrs_of(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def run_worker(bus: Bus, n_tasks: int = 1) -> tuple[TaskPipeline, list[Any]]:
    """Publish tasks, run the worker's intake + pipeline until each is acked; return the raw trajectories."""
    for i in range(n_tasks):
        task = Task(task_id=f"t{i}", env="arith", prompt="1+1=", run_id="run-3", group_size=GROUP)
        await bus.publish("tasks.arith", task, msg_id=task.task_id)
    consumer = await bus.consumer("rollout-worker", Task)
    pipeline = TaskPipeline(
        bus,
        cast(Sampler, StubSampler()),
        Outbox(bus),
        cast(WeightFollower, StubFollower()),
        version_wait_timeout_s=1.0,
        retry_delay_s=0.0,
    )
    intake = TaskIntake(consumer, max_in_flight=4, heartbeat_s=10.0, fetch_timeout_s=0.05)
    stop = asyncio.Event()
    loop = asyncio.create_task(intake.run(pipeline.handle, stop))
    deadline = time.monotonic() + 5
    while pipeline.outcomes["acked"] < n_tasks and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    stop.set()
    await loop
    assert await intake.wait_idle(2.0)
    await consumer.close()
    raw = await bus.consumer("reward-model", Episode)
    published = await raw.fetch(n_tasks * GROUP, 1.0)
    await raw.close()
    return pipeline, published


async def test_with_tracing_off_the_worker_path_makes_no_span_and_sends_no_context(
    bus: Bus, tracer_calls: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", None)
    assert not tracing_active()
    pipeline, published = await run_worker(bus, n_tasks=2)
    assert pipeline.outcomes["acked"] == 2
    assert len(published) == 2 * GROUP
    assert tracer_calls == []
    assert not any("traceparent" in d.headers for d in published)


async def test_each_completion_is_a_generate_span_under_the_tasks_consumer_span(
    bus: Bus, spans: InMemorySpanExporter, tracer_calls: list[str]
) -> None:
    pipeline, published = await run_worker(bus)
    assert pipeline.outcomes["acked"] == 1
    assert tracer_calls  # the probe of the test above does see spans being made
    finished = spans.get_finished_spans()
    (task_publish,) = [s for s in finished if s.name == "publish tasks.arith"]
    (process,) = [s for s in finished if s.name == "process tasks.arith"]
    generate = sorted(
        (s for s in finished if s.name == "rollout.generate"), key=lambda s: attrs_of(s)["slipstream.group_index"]
    )
    # publish span of each trajectory, by the span id of its parent
    sends = {s.parent.span_id: s for s in finished if s.name == "publish traj.raw.arith" and s.parent is not None}

    assert process.kind is SpanKind.CONSUMER
    assert process.parent is not None and process.parent.span_id == task_publish.context.span_id
    assert dict(process.attributes or {})["slipstream.worker_id"] == "rollout-worker/w-7"
    assert len(generate) == GROUP
    for i, gen in enumerate(generate):
        assert gen.parent is not None and gen.parent.span_id == process.context.span_id
        assert (gen.start_time, gen.end_time) == (int(STARTED * 1e9), int(FINISHED * 1e9))
        attrs = attrs_of(gen)
        assert attrs["slipstream.trajectory_id"] == f"t0/g/{i}"
        assert attrs["slipstream.policy_versions"] == (0, 1)
        assert attrs["slipstream.policy_version"] == 0
        assert attrs["slipstream.turns"] == 1
        assert gen.context.span_id in sends  # its trajectory was published inside it
    # Each trajectory's headers carry its own publish span, child of its own generate span.
    trajectory_of = {g.context.span_id: attrs_of(g)["slipstream.trajectory_id"] for g in generate}
    sender_of = {f"{s.context.span_id:016x}": parent for parent, s in sends.items()}
    for d in published:
        assert trajectory_of[sender_of[d.headers["traceparent"].split("-")[2]]] == d.msg.episode_id


class StubEngine:
    policy_version = 0


class MissingStore:
    def get(self, key: str) -> bytes:
        raise FileNotFoundError(key)


async def test_weights_apply_is_a_child_of_the_announce_context(spans: InMemorySpanExporter, bus: Bus) -> None:
    with trace.get_tracer("test").start_as_current_span("announce") as announce_span:
        carrier: dict[str, str] = {}
        inject(carrier)
    follower = WeightFollower(
        bus, cast(Any, MissingStore()), cast(Any, StubEngine()), run_id="r", retries=0, backoff_s=0.0, worker_id="w-3"
    )
    announce = WeightAnnounce(policy_version=4, manifest_key="r/v4/manifest", run_id="r")
    assert await follower.apply(announce, context=extract(carrier)) is False  # nothing to fetch: skipped
    (apply,) = [s for s in spans.get_finished_spans() if s.name == "weights.apply"]
    assert apply.parent is not None and apply.parent.span_id == announce_span.get_span_context().span_id
    assert apply.context.trace_id == announce_span.get_span_context().trace_id
    assert dict(apply.attributes or {}) == {
        "slipstream.run_id": "r",
        "slipstream.policy_version": 4,
        "slipstream.worker_id": "w-3",
        "slipstream.follow": "latest",
        "slipstream.applied": False,
    }


async def test_the_step_context_rides_in_the_staged_file_to_weights_publish(
    spans: InMemorySpanExporter, bus: Bus, tmp_path: Path
) -> None:
    staging = tmp_path / "staging"
    handoff = WeightHandoff(staging)
    with trace.get_tracer("test").start_as_current_span("learner.step") as step:
        carrier: dict[str, str] = {}
        inject(carrier)
        handoff.stage(1, torch.nn.Linear(4, 2), fence={"fence_token": "5"}, trace_context=carrier)
    (staged,) = list_staged(staging)
    assert staged.metadata["traceparent"] == carrier["traceparent"]
    assert staged.metadata["fence_token"] == "5"

    store = setup_store(StoreConfig(root=str(tmp_path / "store")))
    publisher = VersionPublisher(
        bus,
        store,
        run_id="r",
        versions=VersionStore(store, run_id="r", shard_bytes=1 << 20),
        delete_staged=True,
    )
    reader = bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="all")
    await publisher.publish(staged)
    delivery = await asyncio.wait_for(reader.__anext__(), 2.0)
    await reader.close()
    store.close()

    finished = {s.name: s for s in spans.get_finished_spans()}
    publish, send = finished["weights.publish"], finished["publish weights.announce"]
    step_ctx = step.get_span_context()
    assert publish.parent is not None and publish.parent.span_id == step_ctx.span_id
    assert publish.context.trace_id == step_ctx.trace_id
    assert send.parent is not None and send.parent.span_id == publish.context.span_id
    assert delivery.headers["traceparent"].split("-")[1:3] == [
        f"{step_ctx.trace_id:032x}",
        f"{send.context.span_id:016x}",
    ]
    attrs = dict(publish.attributes or {})
    assert (attrs["slipstream.policy_version"], attrs["slipstream.keyframe"]) == (1, True)
    assert cast(int, attrs["slipstream.stored_bytes"]) > 0


class SpanNamingGate:
    """Records the span each judgement ran in."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, int]] = []

    async def consider(self, announce: WeightAnnounce) -> str:
        ctx = trace.get_current_span().get_span_context()
        self.seen.append((announce.policy_version, ctx.span_id))
        return "promoted"


async def test_the_eval_gate_judges_each_announce_in_a_consumer_span(spans: InMemorySpanExporter, bus: Bus) -> None:
    with trace.get_tracer("test").start_as_current_span("weights.publish"):
        await bus.publish(WEIGHTS_ANNOUNCE, WeightAnnounce(policy_version=2, manifest_key="k", run_id="r"))
    consumer = await bus.consumer("eval-gate", WeightAnnounce)
    gate = SpanNamingGate()
    intake = AnnounceIntake(
        consumer,
        cast(Any, gate),
        cast(Any, None),
        batch=1,
        fetch_timeout_s=0.05,
        retry_delay_s=0.0,
        heartbeat_s=10.0,
        skip_superseded=False,
    )
    (d,) = await consumer.fetch(1, 1.0)
    await intake.handle([d], asyncio.Event())
    await consumer.close()
    assert intake.outcomes["promoted"] == 1 and d.settled == "ack"
    finished = {s.name: s for s in spans.get_finished_spans()}
    process, send = finished["process weights.announce"], finished["publish weights.announce"]
    assert process.kind is SpanKind.CONSUMER
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert gate.seen == [(2, process.context.span_id)]


def test_the_provider_keeps_thousands_of_links_unless_the_variable_says() -> None:
    assert span_limits({}).max_links == MAX_LINKS == 4096
    assert span_limits({"OTEL_SPAN_LINK_COUNT_LIMIT": "50"}).max_links == 50
    with pytest.raises(ValueError, match="OTEL_SPAN_LINK_COUNT_LIMIT must be"):
        span_limits({"OTEL_SPAN_LINK_COUNT_LIMIT": "many"})


NONE_SCRIPT = """
import json
from slipstream.bus.tracing import tracing_active
from slipstream.telemetry.config import TelemetryConfig
from slipstream.telemetry.tracing import setup_tracing, tracing_mode

first = setup_tracing("svc", TelemetryConfig(traces="none"), environ={})
again = setup_tracing("svc", TelemetryConfig(traces="none"), environ={})
print(json.dumps([first is None, again is None, tracing_active(), tracing_mode()]))
"""


def test_traces_none_installs_no_provider_so_services_make_no_spans() -> None:
    # A child process: a provider, once installed, stays for the life of the process.
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", NONE_SCRIPT], capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == [True, True, False, "none"]
