"""One contract for every bus backend: the in-memory bus must behave like NATS JetStream.

Each test runs twice, against `memory` and against a real nats-server started on a free port.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

from slipstream.bus import (
    Bus,
    BusConfig,
    BusError,
    Delivery,
    PayloadTooLarge,
    PublishError,
    connect_bus,
    consume,
)
from slipstream.schemas import SCHEMA_HEADER, Episode, Task, Trajectory, WeightAnnounce, encode, pack_ids
from slipstream.schemas.dead_letter import H_DELIVERIES, H_REASON, H_SEQUENCE, H_STREAM, H_SUBJECT, DeadLetter
from slipstream.schemas.subjects import STREAMS, StreamSpec
from slipstream.telemetry.metrics import REGISTRY

pytestmark = pytest.mark.contract

MakeBus = Callable[..., Awaitable[Bus]]


def short_streams(ack_wait_s: float = 0.5, max_deliver: int = 3) -> tuple[StreamSpec, ...]:
    """The subject table with a fast TASKS consumer, for redelivery tests."""
    out = []
    for s in STREAMS:
        if s.name == "TASKS":
            c = msgspec.structs.replace(s.consumers[0], ack_wait_s=ack_wait_s, max_deliver=max_deliver)
            s = msgspec.structs.replace(s, consumers=(c,))
        out.append(s)
    return tuple(out)


@pytest.fixture(params=["memory", "nats"])
def backend(request: pytest.FixtureRequest) -> tuple[str, str]:
    if request.param == "nats":
        return "nats", request.getfixturevalue("nats_server").url
    return "memory", f"memory://{uuid.uuid4().hex}"


@pytest.fixture
async def make_bus(backend: tuple[str, str]) -> AsyncIterator[MakeBus]:
    kind, url = backend
    buses: list[Bus] = []

    async def make(streams: Sequence[StreamSpec] = STREAMS, ensure: bool = True, **overrides: object) -> Bus:
        fields: dict[str, object] = {"fetch_timeout_s": 0.5, "ack_timeout_s": 2.0, **overrides}
        cfg = BusConfig(type=kind, url=url, **fields)  # type: ignore[arg-type]
        bus = await connect_bus(cfg, name=f"contract-{len(buses)}", streams=streams)
        buses.append(bus)
        if ensure:
            await bus.ensure_streams()
        return bus

    yield make
    for b in buses:
        await b.close()


def task(i: int, **kw: object) -> Task:
    return Task(task_id=f"t{i}", env="arith", prompt=f"{i} + {i} = ?", reference=str(2 * i), **kw)  # type: ignore[arg-type]


async def drained(bus: Bus, stream: str = "TASKS", timeout_s: float = 10.0) -> None:
    """`stream` ends empty: acks and terms go out without waiting for the server, so the stream
    can lag the consumer by a moment, longer on a loaded machine."""
    deadline = time.monotonic() + timeout_s
    while (left := (await bus.stream_info(stream))["messages"]) != 0:
        assert time.monotonic() < deadline, f"{stream} still holds {left} messages after {timeout_s}s"
        await asyncio.sleep(0.05)


async def fetch_until(
    bus: Bus, n: int, *, durable: str = "rollout-worker", timeout_s: float = 5.0
) -> list[Delivery[Task]]:
    consumer = await bus.consumer(durable, Task)
    got: list[Delivery[Task]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got.extend(await consumer.fetch(batch=n - len(got), timeout=0.3))
    return got


async def test_round_trip_carries_headers_schema_and_trace_context(make_bus: MakeBus) -> None:
    bus = await make_bus()
    sent = task(1, seed=7, metadata={"k": "v"})
    ctx = SpanContext(trace_id=0x1234, span_id=0x99, is_remote=False, trace_flags=TraceFlags(TraceFlags.SAMPLED))
    with trace.use_span(NonRecordingSpan(ctx)):
        seq = await bus.publish("tasks.arith", sent, msg_id="task-1", headers={"X-Origin": "contract"})
    assert seq >= 1

    (d,) = await fetch_until(bus, 1)
    assert d.msg == sent
    assert d.subject == "tasks.arith"
    assert d.stream_seq == seq
    assert d.num_delivered == 1
    assert d.data == encode(sent)
    assert d.headers[SCHEMA_HEADER] == "Task/1"
    assert d.headers["X-Origin"] == "contract"
    assert d.headers["Nats-Msg-Id"] == "task-1"
    assert d.headers["traceparent"] == f"00-{0x1234:032x}-{0x99:016x}-01"
    assert trace.get_current_span(d.context).get_span_context().trace_id == 0x1234
    assert await d.ack() is True


async def test_stored_sequences_name_what_a_work_queue_still_holds(make_bus: MakeBus) -> None:
    # What the run's accounting reads to tell a settled message whose ack never arrived from one left.
    bus = await make_bus()
    assert await bus.stored_sequences("TASKS") == []
    seqs = [await bus.publish("tasks.arith", task(i)) for i in range(3)]
    got = await fetch_until(bus, 3)
    middle = next(d for d in got if d.stream_seq == seqs[1])
    assert await middle.ack() is True
    deadline = time.monotonic() + 5.0
    while (stored := await bus.stored_sequences("TASKS")) != [seqs[0], seqs[2]]:  # acks are fire-and-forget
        assert time.monotonic() < deadline, stored
        await asyncio.sleep(0.05)
    with pytest.raises((BusError, KeyError), match="NOSUCH"):  # as stream_info: each bus names the stream
        await bus.stored_sequences("NOSUCH")


async def test_ack_removes_from_work_queue_and_double_settlement_is_a_noop(make_bus: MakeBus) -> None:
    bus = await make_bus()
    for i in range(3):
        await bus.publish("tasks.arith", task(i))
    got = await fetch_until(bus, 3)
    assert sorted(d.msg.task_id for d in got) == ["t0", "t1", "t2"]
    info = await bus.stream_info("TASKS")
    assert info["consumers"]["rollout-worker"]["num_ack_pending"] == 3
    for d in got:
        assert await d.ack() is True
    assert await got[0].ack() is False
    assert await got[0].nak() is False
    assert await got[0].in_progress() is False
    await asyncio.sleep(0.2)  # acks are fire-and-forget on NATS
    info = await bus.stream_info("TASKS")
    assert info["messages"] == 0
    assert info["consumers"]["rollout-worker"]["num_ack_pending"] == 0
    consumer = await bus.consumer("rollout-worker", Task)
    assert await consumer.fetch(timeout=0.3) == []


async def test_nak_redelivers_and_respects_the_delay(make_bus: MakeBus) -> None:
    bus = await make_bus()
    await bus.publish("tasks.arith", task(1))
    consumer = await bus.consumer("rollout-worker", Task)
    (first,) = await consumer.fetch(timeout=2.0)
    assert await first.nak() is True
    (second,) = await consumer.fetch(timeout=2.0)
    assert second.num_delivered == 2
    assert second.stream_seq == first.stream_seq
    await second.nak(delay_s=1.0)
    t0 = time.monotonic()
    assert await consumer.fetch(timeout=0.3) == []
    (third,) = await consumer.fetch(timeout=3.0)
    assert third.num_delivered == 3
    assert time.monotonic() - t0 >= 0.6
    await third.ack()


async def test_unacked_message_comes_back_after_ack_wait(make_bus: MakeBus) -> None:
    bus = await make_bus(streams=short_streams(ack_wait_s=0.5, max_deliver=5))
    await bus.publish("tasks.arith", task(1))
    consumer = await bus.consumer("rollout-worker", Task)
    (first,) = await consumer.fetch(timeout=2.0)
    assert first.num_delivered == 1
    await first.in_progress()
    assert await consumer.fetch(timeout=0.2) == []
    (again,) = await consumer.fetch(timeout=3.0)
    assert again.num_delivered == 2
    assert again.msg == first.msg
    await again.ack()


async def test_republished_msg_id_is_a_duplicate(make_bus: MakeBus) -> None:
    bus = await make_bus()
    dups = REGISTRY.counter("bus/publish/duplicates").total()
    seq1 = await bus.publish("tasks.arith", task(1), msg_id="same-id")
    seq2 = await bus.publish("tasks.arith", task(1), msg_id="same-id")
    seq3 = await bus.publish("tasks.arith", task(2), msg_id="other-id")
    assert seq2 == seq1
    assert seq3 == seq1 + 1
    assert REGISTRY.counter("bus/publish/duplicates").total() == dups + 1
    got = await fetch_until(bus, 3, timeout_s=1.5)
    assert [d.msg.task_id for d in got] == ["t1", "t2"]
    assert (await bus.stream_info("TASKS"))["messages"] == 2


async def test_bad_messages_go_to_the_dlq_with_reason_and_original_bytes(make_bus: MakeBus) -> None:
    bus = await make_bus()
    dlq_count = REGISTRY.counter("bus/dlq/messages")
    before_decode = dlq_count.value(stream="TASKS", reason="decode")
    before_schema = dlq_count.value(stream="TASKS", reason="schema")
    garbage = b"\xc1 definitely not msgpack"
    newer = encode(task(2))
    await bus.publish("tasks.arith", task(1))
    seq_bad = await bus.publish_raw("tasks.arith", garbage, {SCHEMA_HEADER: "Task/1", "X-Keep": "me"})
    seq_newer = await bus.publish_raw("tasks.arith", newer, {SCHEMA_HEADER: "Task/99"})
    seq_other = await bus.publish_raw("tasks.arith", newer, {SCHEMA_HEADER: "Trajectory/1"})
    await bus.publish("tasks.arith", task(3))

    got = await fetch_until(bus, 2)
    assert [d.msg.task_id for d in got] == ["t1", "t3"]
    for d in got:
        await d.ack()

    letters = await bus.dead_letters("TASKS")
    assert len(letters) == 3
    by_seq = {dl.sequence: dl for dl in letters}
    assert set(by_seq) == {seq_bad, seq_newer, seq_other}
    bad = by_seq[seq_bad]
    assert bad.data == garbage
    assert bad.reason.startswith("decode:")
    assert bad.stream == "TASKS" and bad.subject == "tasks.arith" and bad.consumer == "rollout-worker"
    assert bad.deliveries == 1
    assert bad.headers["X-Keep"] == "me"
    assert bad.headers[H_STREAM] == "TASKS" and bad.headers[H_SUBJECT] == "tasks.arith"
    assert bad.headers[H_SEQUENCE] == str(seq_bad) and bad.headers[H_DELIVERIES] == "1"
    assert by_seq[seq_newer].data == newer
    assert by_seq[seq_newer].reason.startswith("schema:") and "Task/99" in by_seq[seq_newer].headers[H_REASON]
    assert by_seq[seq_other].reason.startswith("schema:") and "Trajectory" in by_seq[seq_other].reason
    assert dlq_count.value(stream="TASKS", reason="decode") == before_decode + 1
    assert dlq_count.value(stream="TASKS", reason="schema") == before_schema + 2
    await drained(bus)  # bad ones were terminated


async def test_episode_consumer_admits_v1_trajectories_upgraded(make_bus: MakeBus) -> None:
    """Producers still publishing v1 `Trajectory` reach a consumer that reads `Episode` (codec.UPGRADES)."""
    bus = await make_bus()
    old = Trajectory(trajectory_id="tr-1", task_id="t", env="arith", prompt_len=1, token_ids=pack_ids([4, 5, 6]))
    new = Episode(episode_id="ep-2", task_id="t", env="arith")
    await bus.publish("traj.raw.arith", old, msg_id=old.trajectory_id)
    await bus.publish("traj.raw.arith", new, msg_id=new.episode_id)
    seq_newer = await bus.publish_raw("traj.raw.arith", encode(old), {SCHEMA_HEADER: "Trajectory/9"})
    consumer = await bus.consumer("reward-model", Episode)
    got: list[Delivery[Episode]] = []
    deadline = time.monotonic() + 5.0
    while len(got) < 2 and time.monotonic() < deadline:
        got.extend(await consumer.fetch(batch=2, timeout=0.3))
    assert [type(d.msg) for d in got] == [Episode, Episode]
    assert [d.msg.episode_id for d in got] == ["tr-1", "ep-2"]
    assert got[0].msg.samples[0].ids() == [4, 5, 6] and got[0].headers[SCHEMA_HEADER] == "Trajectory/1"
    for d in got:
        await d.ack()
    assert await consumer.fetch(batch=1, timeout=0.3) == []  # the newer version went to the DLQ instead
    (letter,) = await bus.dead_letters("TRAJ_RAW")
    assert letter.sequence == seq_newer and letter.reason.startswith("schema:")


async def test_nak_on_the_last_delivery_dead_letters(make_bus: MakeBus) -> None:
    bus = await make_bus(streams=short_streams(ack_wait_s=5.0, max_deliver=2))
    seq = await bus.publish("tasks.arith", task(1))
    consumer = await bus.consumer("rollout-worker", Task)
    (d1,) = await consumer.fetch(timeout=2.0)
    await d1.nak()
    (d2,) = await consumer.fetch(timeout=2.0)
    assert d2.num_delivered == 2
    await d2.nak()  # max_deliver used up: to the DLQ, not back to the queue
    assert await consumer.fetch(timeout=0.3) == []
    (letter,) = await bus.dead_letters("TASKS")
    assert letter.reason.startswith("max_deliveries:")
    assert letter.sequence == seq and letter.deliveries == 2
    assert letter.data == d1.data
    await drained(bus)


async def test_consumer_that_never_settles_is_dead_lettered_on_the_spare_delivery(make_bus: MakeBus) -> None:
    bus = await make_bus(streams=short_streams(ack_wait_s=0.3, max_deliver=2))
    await bus.publish("tasks.arith", task(1))
    consumer = await bus.consumer("rollout-worker", Task)
    seen: list[int] = []
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and len(seen) < 2:
        seen.extend(d.num_delivered for d in await consumer.fetch(timeout=0.5))  # never settled
    assert seen == [1, 2]
    deadline = time.monotonic() + 5.0
    letters: list[DeadLetter] = []
    while time.monotonic() < deadline and not letters:
        assert await consumer.fetch(timeout=0.5) == []  # the 3rd delivery is dead-lettered, not returned
        letters = await bus.dead_letters("TASKS")
    assert len(letters) == 1
    assert letters[0].reason.startswith("max_deliveries:") and letters[0].deliveries == 3


async def test_oversized_payload_is_refused_before_sending(make_bus: MakeBus) -> None:
    bus = await make_bus()
    limit = bus.max_payload
    assert limit == 1024 * 1024
    big = task(1, metadata={"blob": "x" * (limit + 10)})
    with pytest.raises(PayloadTooLarge) as err:
        await bus.publish("tasks.arith", big)
    text = str(err.value)
    assert "'tasks.arith'" in text and str(limit) in text
    size = int(text.split(" is ")[1].split(" bytes")[0])
    assert size > limit
    with pytest.raises(PayloadTooLarge):
        await bus.publish_async("tasks.arith", big)
    assert bus.connected
    assert await bus.publish("tasks.arith", task(2)) >= 1  # the connection survived
    assert (await bus.stream_info("TASKS"))["messages"] == 1


async def test_publish_without_a_stream_names_the_subject(make_bus: MakeBus) -> None:
    bus = await make_bus(ensure=False)
    with pytest.raises(PublishError, match=r"tasks\.nowhere"):
        await bus.publish("tasks.nowhere", task(1))


async def test_pipelined_publish_is_bounded_and_flushes(make_bus: MakeBus) -> None:
    bus = await make_bus(max_inflight_msgs=8, max_inflight_bytes=64 * 1024)
    futures = []
    peak = 0
    for i in range(300):
        futures.append(await bus.publish_async("tasks.arith", task(i), msg_id=f"p{i}"))
        peak = max(peak, bus.in_flight[0])
        assert bus.in_flight[0] <= 8 and bus.in_flight[1] <= 64 * 1024
    await bus.flush(timeout=10)
    assert bus.in_flight == (0, 0)
    seqs = [f.result() for f in futures]
    assert seqs == sorted(seqs) and len(set(seqs)) == 300
    assert (await bus.stream_info("TASKS"))["messages"] == 300


async def test_failed_async_publish_is_reported_by_flush(make_bus: MakeBus) -> None:
    bus = await make_bus(ensure=False)
    fut = await bus.publish_async("tasks.arith", task(1))
    with pytest.raises(PublishError, match="1 publishes failed"):
        await bus.flush(timeout=5)
    assert isinstance(fut.exception(), PublishError)
    await bus.flush(timeout=1)  # reported once


async def test_subscribe_fans_out_from_the_latest_announce(make_bus: MakeBus) -> None:
    bus = await make_bus()
    for v in (1, 2):
        await bus.publish("weights.announce", WeightAnnounce(policy_version=v, manifest_key=f"m/{v}"))
    readers = [bus.subscribe("weights.announce", WeightAnnounce, deliver="last") for _ in range(2)]
    every = bus.subscribe("weights.announce", WeightAnnounce, deliver="all")
    for r in [*readers, every]:
        await r.start()  # type: ignore[attr-defined]
    for r in readers:
        d = await asyncio.wait_for(anext(r), 5)
        assert d.msg.policy_version == 2
        assert await d.ack() is True  # a no-op on fan-out, never an error
    await bus.publish("weights.announce", WeightAnnounce(policy_version=3, manifest_key="m/3"))
    for r in readers:
        assert (await asyncio.wait_for(anext(r), 5)).msg.policy_version == 3
    versions = [(await asyncio.wait_for(anext(every), 5)).msg.policy_version for _ in range(3)]
    assert versions == [1, 2, 3]
    for r in [*readers, every]:
        await r.close()
    info = await bus.stream_info("WEIGHTS")
    assert info["messages"] == 3  # a log: reading removes nothing


async def test_replicas_share_one_durable(make_bus: MakeBus) -> None:
    a, b = await make_bus(), await make_bus()
    for i in range(20):
        await a.publish("tasks.arith", task(i))
    ca, cb = await a.consumer("rollout-worker", Task), await b.consumer("rollout-worker", Task)
    seen: list[str] = []
    deadline = time.monotonic() + 5
    while len(seen) < 20 and time.monotonic() < deadline:
        for c in (ca, cb):
            for d in await c.fetch(batch=3, timeout=0.3):
                seen.append(d.msg.task_id)
                await d.ack()
    assert sorted(seen) == sorted(f"t{i}" for i in range(20))


async def test_ensure_streams_is_idempotent_under_concurrency(make_bus: MakeBus) -> None:
    buses = [await make_bus(ensure=False) for _ in range(3)]
    await asyncio.gather(*(b.ensure_streams() for b in buses))
    await buses[0].ensure_streams()
    for spec in STREAMS:
        info = await buses[1].stream_info(spec.name)
        assert info["messages"] == 0
        assert set(info["consumers"]) == {c.durable for c in spec.consumers}


async def test_consume_loop_acks_naks_failures_and_keeps_going(make_bus: MakeBus) -> None:
    bus = await make_bus()
    for i in range(10):
        await bus.publish("tasks.arith", task(i))
    consumer = await bus.consumer("rollout-worker", Task)
    stop = asyncio.Event()
    done: list[str] = []
    errors_before = REGISTRY.counter("bus/consume/errors").value(reason="handler")

    async def handle(d: Delivery[Task]) -> None:
        if d.msg.task_id == "t4" and d.num_delivered == 1:
            raise RuntimeError("flaky once")
        done.append(d.msg.task_id)
        if len(done) == 10:
            stop.set()

    stats = await asyncio.wait_for(
        consume(consumer, handle, stop=stop, concurrency=3, error_delay_s=0.1, fetch_timeout_s=0.3), 15
    )
    assert sorted(done) == sorted(f"t{i}" for i in range(10))
    assert stats.handled == 10 and stats.failed == 1 and stats.released == 0
    assert REGISTRY.counter("bus/consume/errors").value(reason="handler") == errors_before + 1
    await drained(bus)


async def test_consume_loop_hands_back_unstarted_work_on_stop(make_bus: MakeBus) -> None:
    bus = await make_bus()
    for i in range(10):
        await bus.publish("tasks.arith", task(i))
    consumer = await bus.consumer("rollout-worker", Task)
    stop = asyncio.Event()

    async def handle(d: Delivery[Task]) -> None:
        stop.set()  # SIGTERM arrives while the first task runs

    stats = await asyncio.wait_for(consume(consumer, handle, stop=stop, batch=10), 10)
    assert stats.handled == 1 and stats.released == 9
    rest = await fetch_until(bus, 9, timeout_s=3)  # handed back at once, not after ack_wait
    assert len(rest) == 9 and all(d.num_delivered == 2 for d in rest)


async def test_concurrent_fetches_on_one_consumer_split_the_work(make_bus: MakeBus) -> None:
    bus = await make_bus()
    for i in range(10):
        await bus.publish("tasks.arith", task(i))
    consumer = await bus.consumer("rollout-worker", Task)
    a, b = await asyncio.gather(consumer.fetch(batch=5, timeout=2.0), consumer.fetch(batch=5, timeout=2.0))
    ids = [d.msg.task_id for d in a + b]
    assert len(a) == 5 and len(b) == 5
    assert sorted(ids) == sorted(f"t{i}" for i in range(10))
