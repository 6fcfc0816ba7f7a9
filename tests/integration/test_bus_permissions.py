"""Least privilege on a real nats-server: each service's user can do what the subject table says, nothing else.

The server runs with the users `slipstream.bus.permissions` generates (fresh random passwords).
The expectations below are written out by hand, not read back from the generator, so a wrong
row in the table or a wrong rule in the generator fails here, and the server is what refuses.

- publish: every service publishes each concrete subject of the table; only its own are stored,
  the rest are refused by the server (a permissions violation, reported at once, not at the ack
  timeout);
- consume: each durable is pulled and acked by its own service only; another service's pull
  request or ack is refused;
- read: fan-out views of a subject can be opened only by the services that read it, only through
  the named create, under a name that is not a durable's (a reader cannot redefine eval-gate's
  durable on WEIGHTS), and the bus's own readers work under these rights, recreated after a gap;
- inboxes: a service cannot subscribe to another service's replies (where pull deliveries arrive);
- forgery: a well-formed scored episode published with the rollout worker's or the task source's
  credentials (or none) never reaches the learner's durable, while the reward model's does.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest
from nats.js.api import ConsumerConfig
from scored_trajectories import trajectory

from slipstream.bus import Bus, BusConfig, BusUnavailable, PublishError, connect_bus
from slipstream.bus.envelope import envelope
from slipstream.bus.instruments import DENIED
from slipstream.bus.permissions import (
    ADMIN,
    all_permissions,
    fanout_name,
    inbox_prefix,
    new_passwords,
    server_authorization,
)
from slipstream.schemas import LearnerStep, ScoredEpisode, ScoredTrajectory, Task, WeightAnnounce, WeightsPromoted
from slipstream.schemas.subjects import STREAMS, dlq_subject, traj_scored_subject
from slipstream.stack import Server, start_nats

pytestmark = pytest.mark.integration

SERVICES = (
    "eval-gate",
    "learner",
    "reward-model",
    "rollout-worker",
    "subagent-pool",
    "task-source",
    "tool-service",
    "weight-publisher",
)
SUBJECTS = (
    "tasks.arith",
    "traj.raw.arith",
    "traj.scored.arith",
    "weights.announce",
    "weights.promoted",
    "eval.result",
    "learner.step",
    "subagents.lookup",
    *(dlq_subject(s.name) for s in STREAMS if s.name != "DLQ"),
)
MAY_PUBLISH = {
    "task-source": {"tasks.arith"},
    "rollout-worker": {"traj.raw.arith", "dlq.TASKS", "subagents.lookup"},
    "subagent-pool": {"dlq.SUBAGENTS"},  # and replies into the rollout workers' inboxes (below)
    "reward-model": {"traj.scored.arith", "dlq.TRAJ_RAW"},
    "learner": {"learner.step", "dlq.TRAJ_SCORED"},
    "weight-publisher": {"weights.announce"},
    "eval-gate": {"weights.promoted", "eval.result", "dlq.WEIGHTS"},
    "tool-service": set(),  # replies to the tool calls it receives, nothing else (below)
}
DURABLES = {
    "rollout-worker": "TASKS",
    "reward-model": "TRAJ_RAW",
    "learner": "TRAJ_SCORED",
    "eval-gate": "WEIGHTS",
    "subagent-pool": "SUBAGENTS",
}
MAY_READ = {  # fan-out (ordered consumer) views, per subject
    "weights.announce": {"rollout-worker", "learner", "task-source", "subagent-pool"},
    "weights.promoted": {"rollout-worker", "eval-gate"},
    "learner.step": {"task-source"},
    "eval.result": set(),
    "dlq.TASKS": set(),
}
STREAM_OF = {
    "weights.announce": "WEIGHTS",
    "weights.promoted": "WEIGHTS",
    "learner.step": "LEARNER",
    "eval.result": "EVAL",
    "dlq.TASKS": "DLQ",
}


# How long a test waits for what must arrive (a passing test waits no longer than the server takes).
# CI runs four xdist workers beside mypy on 2 cores: a reply published at once missed a 10 s wait
# there (the pool-inbox test, once), so a stall, not a refusal, is what this allows for.
SETTLE_S = 30.0


async def server_errors(errors: list[str], needle: str, expected: int) -> list[str]:
    """The errors containing `needle`, once `expected` of them came (or SETTLE_S passed), and a beat more for extras."""
    deadline = asyncio.get_running_loop().time() + SETTLE_S
    while sum(needle in e.lower() for e in errors) < expected and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.2)
    return [e for e in errors if needle in e.lower()]


class Secured:
    def __init__(self, server: Server, passwords: dict[str, str]) -> None:
        self.server = server
        self.passwords = passwords

    def cfg(self, user: str, **kw: Any) -> BusConfig:
        return BusConfig(url=self.server.url, user=user, password=self.passwords[user], **kw)

    async def raw(self, user: str) -> tuple[nats.NATS, list[str]]:
        """A bare nats-py client as `user`, and the server errors it was sent."""
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(str(exc))

        nc = await nats.connect(
            self.server.url,
            user=user,
            password=self.passwords[user],
            inbox_prefix=inbox_prefix(user),
            error_cb=on_error,
            allow_reconnect=False,
        )
        return nc, errors


@pytest.fixture
def secured(tmp_path: Path) -> Iterator[Secured]:
    passwords = new_passwords(p.user for p in all_permissions())
    srv = start_nats(tmp_path / "nats", tmp_path / "logs", authorization=server_authorization(passwords))
    try:
        yield Secured(srv, passwords)
    finally:
        srv.stop()


@pytest.fixture
async def admin(secured: Secured) -> AsyncIterator[Bus]:
    bus = await connect_bus(secured.cfg(ADMIN), name="provision")
    await bus.ensure_streams()
    yield bus
    await bus.close()


def scored(episode_id: str) -> ScoredTrajectory:
    """A well-formed scored trajectory (the learner decodes it as a ScoredEpisode): only the server stops a forgery."""
    return trajectory(episode_id, f"{episode_id}/s1", size=1, reward=1.0)


async def test_the_servers_users_are_the_tables_services(secured: Secured) -> None:
    assert sorted(secured.passwords) == sorted((ADMIN, *SERVICES))


@pytest.mark.parametrize("service", SERVICES)
async def test_each_service_publishes_exactly_its_subjects(secured: Secured, admin: Bus, service: str) -> None:
    bus = await connect_bus(secured.cfg(service, ack_timeout_s=5.0, publish_retries=0), name=service)
    try:
        if service != "tool-service":  # no JetStream role, so not even the topology to read
            await bus.ensure_streams()  # provisioned by the admin: a service only reads the topology
        before = {s.name: (await admin.stream_info(s.name))["messages"] for s in STREAMS}
        stored, refused = set(), set()
        for subject in SUBJECTS:
            data, hdrs = envelope(
                subject, Task(task_id=f"{service}-{subject}", env="arith", prompt="1+1"), None, None, 1 << 20
            )
            try:
                await asyncio.wait_for(bus.publish_raw(subject, data, hdrs), SETTLE_S)
                stored.add(subject)
            except PublishError as exc:
                assert "permission denied" in str(exc), exc
                refused.add(subject)
        after = {s.name: (await admin.stream_info(s.name))["messages"] for s in STREAMS}
    finally:
        await bus.close()
    assert stored == MAY_PUBLISH[service]
    assert refused == set(SUBJECTS) - MAY_PUBLISH[service]
    grew = sum(after[n] - before[n] for n in after)
    assert grew == len(MAY_PUBLISH[service]), "a refused publish reached a stream"


@pytest.mark.parametrize("service", SERVICES)
async def test_each_durable_is_pulled_and_acked_by_its_service_only(secured: Secured, admin: Bus, service: str) -> None:
    nc, errors = await secured.raw(service)
    try:
        for durable, stream in DURABLES.items():
            errors.clear()
            inbox = nc.new_inbox()
            sub = await nc.subscribe(inbox)
            await nc.publish(
                f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{durable}", b'{"batch":1,"expires":200000000}', reply=inbox
            )
            await nc.publish(f"$JS.ACK.{stream}.{durable}.1.1.1.0.0", b"")
            await nc.flush()
            got: list[Any] = []
            try:
                # The server's 408 when the pull expires empty (0.2 s); a refused pull gets nothing.
                got.append(await sub.next_msg(timeout=SETTLE_S if durable == service else 1.0))
            except nats.errors.TimeoutError:
                pass
            await sub.unsubscribe()
            denied = [e for e in errors if "permissions violation" in e.lower()]
            if durable == service:
                assert got and not denied, (durable, errors)
            else:
                assert not got, f"{service} pulled from {durable}"
                assert len(denied) == 2, (durable, errors)  # the pull and the ack
    finally:
        await nc.close()


def denied_create(errors: list[str], stream: str) -> bool:
    return any(
        "permissions violation" in e.lower() and f"consumer.create.{stream}".lower() in e.lower() for e in errors
    )


@pytest.mark.parametrize("service", SERVICES)
async def test_fanout_views_open_only_for_the_subjects_readers(secured: Secured, admin: Bus, service: str) -> None:
    nc, errors = await secured.raw(service)
    js_refused = nc.jetstream(timeout=1.0)  # a refused create is never answered: wait 1 s for nothing
    js_granted = nc.jetstream(timeout=SETTLE_S)
    try:
        for subject, readers in MAY_READ.items():
            stream = STREAM_OF[subject]
            errors.clear()
            try:  # as the bus opens a view: a fresh name of the service's, filtered to the subject
                config = ConsumerConfig(name=fanout_name(service))
                js = js_granted if service in readers else js_refused
                psub = await js.subscribe(subject, stream=stream, ordered_consumer=True, config=config)
                opened = True
                await psub.unsubscribe()
            except (nats.errors.TimeoutError, nats.errors.Error):
                opened = False
            assert opened == (service in readers), (service, subject, errors)
            if not opened:
                assert denied_create(errors, stream), errors
        # The unnamed create (nats-py's default for an ordered consumer) is nobody's.
        errors.clear()
        with pytest.raises(nats.errors.TimeoutError):
            await js_refused.subscribe("weights.announce", stream="WEIGHTS", ordered_consumer=True)
        assert denied_create(errors, "WEIGHTS"), errors
        # A reader's rights are per subject: a view of WEIGHTS filtered to another subject is refused.
        if service == "learner":
            errors.clear()
            config = ConsumerConfig(name=fanout_name(service))
            with pytest.raises(nats.errors.TimeoutError):
                await js_refused.subscribe("weights.promoted", stream="WEIGHTS", ordered_consumer=True, config=config)
            assert denied_create(errors, "WEIGHTS"), errors
    finally:
        await nc.close()


SAMPLES: dict[str, Any] = {
    "weights.announce": WeightAnnounce(policy_version=7, manifest_key="weights/run/7/manifest.json"),
    "weights.promoted": WeightsPromoted(policy_version=7, manifest_key="weights/run/7/manifest.json"),
    "learner.step": LearnerStep(step=7, policy_version=7),
}
READERS = sorted({name for readers in MAY_READ.values() for name in readers})


@pytest.mark.parametrize("service", READERS)
async def test_the_bus_opens_each_readers_views_under_names_of_its_own(
    secured: Secured, admin: Bus, service: str
) -> None:
    reads = [subject for subject, readers in MAY_READ.items() if service in readers]
    for subject in reads:
        await admin.publish(subject, SAMPLES[subject])
    denied_before = DENIED.value(op="publish")
    bus = await connect_bus(secured.cfg(service), name=service)
    try:
        for subject in reads:
            async with bus.subscribe(subject, type(SAMPLES[subject]), deliver="last") as reader:
                got = await asyncio.wait_for(anext(reader), SETTLE_S)
                assert got.msg == SAMPLES[subject]
                names = set((await admin.stream_info(STREAM_OF[subject]))["consumers"])
                assert [n for n in names if n.startswith(f"{service}-")], names
    finally:
        await bus.close()
    assert DENIED.value(op="publish") == denied_before  # nothing the bus asked for was refused


async def test_a_recreated_fanout_view_takes_a_fresh_name(secured: Secured, admin: Bus) -> None:
    bus = await connect_bus(secured.cfg("rollout-worker"), name="rollout-worker")
    reader = bus.subscribe("weights.announce", WeightAnnounce, deliver="new")
    try:
        await reader.start()
        psub = reader._handle
        first = psub._consumer
        # What nats-py 2.16 does on a gap in the consumer's sequence or two missed heartbeats,
        # while the consumer it replaces still exists (recreated under the old name, that would be
        # an update the server refuses, and the view would stay silent until the next reset).
        jsi = psub._sub._jsi
        await jsi.reset_ordered_consumer(jsi._sseq + 1)
        await admin.publish("weights.announce", WeightAnnounce(policy_version=1, manifest_key="k1"))
        got = await asyncio.wait_for(anext(reader), SETTLE_S)
        assert got.msg.policy_version == 1
        assert psub._consumer != first and psub._consumer.startswith("rollout-worker-"), (first, psub._consumer)
    finally:
        await reader.close()
        await bus.close()


async def test_a_service_cannot_listen_on_another_services_inbox(secured: Secured, admin: Bus) -> None:
    nc, errors = await secured.raw("rollout-worker")
    try:
        await nc.subscribe(inbox_prefix("learner") + ".>")
        await nc.subscribe("traj.scored.>")
        await nc.flush()
        denied = await server_errors(errors, "permissions violation for subscription", 2)
        assert len(denied) == 2, errors
    finally:
        await nc.close()


async def test_the_pool_answers_into_rollout_worker_inboxes_only(secured: Secured, admin: Bus) -> None:
    worker, _ = await secured.raw("rollout-worker")
    pool, errors = await secured.raw("subagent-pool")
    try:
        inbox = worker.new_inbox()  # what a worker names in Slipstream-Reply-To
        sub = await worker.subscribe(inbox)
        await worker.flush()
        await pool.publish(inbox, b"reply")
        await pool.publish(inbox_prefix("learner") + ".x", b"not for the learner")
        await pool.flush()
        assert (await sub.next_msg(timeout=SETTLE_S)).data == b"reply"
        denied = await server_errors(errors, "permissions violation for publish", 1)
        assert len(denied) == 1 and "_inbox.learner" in denied[0].lower(), errors
    finally:
        await worker.close()
        await pool.close()


async def test_no_credentials_no_connection(secured: Secured) -> None:
    with pytest.raises(BusUnavailable, match="without credentials"):
        await connect_bus(BusConfig(url=secured.server.url, connect_budget_s=1.0), name="anonymous")
    wrong = BusConfig(url=secured.server.url, user="learner", password="not-it", connect_budget_s=1.0)
    with pytest.raises(BusUnavailable, match="as user 'learner'"):
        await connect_bus(wrong, name="guess")


async def test_a_forged_scored_episode_never_reaches_the_learner(secured: Secured, admin: Bus) -> None:
    learner = await connect_bus(secured.cfg("learner"), name="learner")
    consumer = await learner.consumer("learner", ScoredEpisode)
    forgers = {
        name: await connect_bus(secured.cfg(name, ack_timeout_s=5.0, publish_retries=0), name=name)
        for name in ("rollout-worker", "task-source")
    }
    reward = await connect_bus(secured.cfg("reward-model"), name="reward-model")
    try:
        denied_before = DENIED.value(op="publish")
        for name, bus in forgers.items():
            with pytest.raises(PublishError, match="permission denied"):
                await asyncio.wait_for(bus.publish(traj_scored_subject("arith"), scored(f"forged-{name}")), SETTLE_S)
        await reward.publish(traj_scored_subject("arith"), scored("genuine"))
        seen: list[str] = []
        deadline = asyncio.get_running_loop().time() + SETTLE_S
        for _ in range(3):  # and on until the genuine one came, on a loaded machine
            for d in await consumer.fetch(16, 0.5):
                seen.append(d.msg.episode.episode_id)
                await d.ack()
        while "genuine" not in seen and asyncio.get_running_loop().time() < deadline:
            for d in await consumer.fetch(16, 0.5):
                seen.append(d.msg.episode.episode_id)
                await d.ack()
        info = await admin.stream_info("TRAJ_SCORED")
    finally:
        for bus in (*forgers.values(), reward):
            await bus.close()
        await consumer.close()
        await learner.close()
    assert seen == ["genuine"]
    assert info["last_seq"] == 1, "a forged episode was stored in TRAJ_SCORED"
    assert DENIED.value(op="publish") == denied_before + 2


async def test_a_service_cannot_create_or_delete_streams_and_durables(secured: Secured, admin: Bus) -> None:
    nc, errors = await secured.raw("rollout-worker")
    try:
        config = json.dumps({"stream_name": "WEIGHTS", "config": {"durable_name": "eval-gate", "ack_policy": "none"}})
        for subject, body in (
            ("$JS.API.STREAM.DELETE.TRAJ_SCORED", b""),
            ("$JS.API.STREAM.PURGE.TRAJ_SCORED", b""),
            ("$JS.API.STREAM.CREATE.EVIL", json.dumps({"name": "EVIL", "subjects": ["evil.>"]}).encode()),
            ("$JS.API.CONSUMER.DELETE.TRAJ_SCORED.learner", b""),
            ("$JS.API.CONSUMER.DURABLE.CREATE.WEIGHTS.eval-gate", config.encode()),
            ("$JS.API.CONSUMER.CREATE.TRAJ_SCORED.thief", b"{}"),
        ):
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(subject, body, timeout=0.5)
        assert sum("permissions violation" in e.lower() for e in errors) == 6, errors
        info = await admin.stream_info("TRAJ_SCORED")
        assert set(info["consumers"]) == {"learner"}
    finally:
        await nc.close()


async def api(nc: nats.NATS, subject: str, body: dict[str, Any]) -> dict[str, Any]:
    reply = await nc.request(subject, json.dumps(body).encode(), timeout=SETTLE_S)
    out: dict[str, Any] = json.loads(reply.data)
    return out


@pytest.mark.parametrize("reader", sorted(MAY_READ["weights.announce"]))
async def test_a_reader_cannot_redefine_another_services_durable(secured: Secured, admin: Bus, reader: str) -> None:
    nc, errors = await secured.raw(reader)
    before = await admin.js.consumer_info("WEIGHTS", "eval-gate")
    try:
        evil = {
            "ack_policy": "explicit",
            "deliver_policy": "all",
            "filter_subject": "weights.announce",
            "ack_wait": 10**9,
        }
        mine = fanout_name(reader)
        refused = (  # each would rewrite eval-gate's durable; the server refuses the subject itself
            ("$JS.API.CONSUMER.CREATE.WEIGHTS", {**evil, "name": "eval-gate"}),  # the unnamed create
            ("$JS.API.CONSUMER.CREATE.WEIGHTS.eval-gate.weights.announce", {**evil, "name": "eval-gate"}),
            ("$JS.API.CONSUMER.DURABLE.CREATE.WEIGHTS.eval-gate", {**evil, "durable_name": "eval-gate"}),
        )
        for subject, config in refused:
            body = json.dumps({"stream_name": "WEIGHTS", "config": config}).encode()
            with pytest.raises(nats.errors.TimeoutError):
                await nc.request(subject, body, timeout=0.5)
        assert sum("permissions violation" in e.lower() for e in errors) == 3, errors
        # Through a name of its own the body cannot point elsewhere: the server goes by the subject.
        own = f"$JS.API.CONSUMER.CREATE.WEIGHTS.{mine}.weights.announce"
        renamed = await api(nc, own, {"stream_name": "WEIGHTS", "config": {**evil, "name": "eval-gate"}})
        assert renamed["name"] == mine, renamed
        reply = await api(nc, own, {"stream_name": "WEIGHTS", "config": {**evil, "durable_name": "eval-gate"}})
        assert reply["error"]["err_code"] == 10017, reply  # consumer name in subject does not match durable name
        after = await admin.js.consumer_info("WEIGHTS", "eval-gate")
        assert after.config == before.config
        assert after.config.ack_wait == 30.0  # the table's ack_wait_s, not the forged 1 s
    finally:
        await nc.close()


async def test_tool_calls_go_only_from_workers_to_the_tool_service(secured: Secured) -> None:
    from slipstream.tool_service.memory import CallMemory
    from slipstream.tool_service.server import ToolServer
    from slipstream.tool_service.toolsets import build_registry
    from slipstream.toolcalls import ToolCall, ToolsConfig
    from slipstream.toolcalls.remote import NatsTransport

    registry = build_registry(["calc"], {})
    once = ToolsConfig(transport="nats", retries=0, reply_margin_s=0.5)
    server_nc, server_errors_seen = await secured.raw("tool-service")
    server = ToolServer(server_nc, registry, replica="tool-service/t", concurrency=4, memory=CallMemory(16, 60.0))
    await server.start()
    worker_nc, _ = await secured.raw("rollout-worker")
    reward_nc, reward_errors = await secured.raw("reward-model")
    try:
        worker = NatsTransport.from_config(worker_nc, registry, once, caller="worker")
        ok = await worker.invoke(ToolCall(id="call-1", name="calculator", arguments={"expression": "2+3"}))
        assert (ok.outcome, ok.text) == ("ok", "5")
        # The reward model has no business calling tools: its request never reaches a replica.
        outsider = NatsTransport.from_config(reward_nc, registry, once, caller="reward")
        refused = await outsider.invoke(ToolCall(id="call-2", name="calculator", arguments={"expression": "1+1"}))
        assert refused.outcome != "ok"
        assert any("permissions violation" in e.lower() and "tools.call" in e.lower() for e in reward_errors)
        assert server.counts["handled"] == 1
        # The tool-service answers requests only: no trajectories, no listening outside its queue group.
        await server_nc.publish("traj.raw.arith", b"{}")
        await server_nc.subscribe("tools.call.*")
        await server_nc.flush()
        assert len(await server_errors(server_errors_seen, "permissions violation", 2)) == 2, server_errors_seen
    finally:
        for nc in (server_nc, worker_nc, reward_nc):
            await nc.close()
