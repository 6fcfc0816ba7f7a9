"""Feedback, the pending stage, admission and version splits, through the real endpoint (issue 16, item 2).

A real TorchEngine (tiny byte-level preset, `tags` renderer) serves the real `openai` client over
loopback. Feedback is posted over HTTP like any client would. The end-to-end test runs two
endpoint replicas sharing one real Redis and a real nats-server, with the reward-model service
in-process scoring what they release with a reward spec.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from aiohttp import ClientSession

from slipstream.bus import BusConfig, connect_bus
from slipstream.engine import CausalLM, TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.schemas import Episode, ScoredEpisode
from slipstream.serve import (
    VERSION_HEADER,
    MemoryPending,
    MemorySink,
    RedisPending,
    ServeConfig,
    ServeEndpoint,
    StoreSink,
    pending_policy,
)
from slipstream.store import LocalObjectStore
from slipstream.store.episodes import load, load_scored

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOK = ByteTokenizer()
MODEL = "slipstream-tiny"


@pytest.fixture(scope="module")
def model() -> CausalLM:
    torch.set_num_threads(1)
    m, _ = build_tiny("tiny", seed=0)
    return m


@pytest.fixture
async def engine(model: CausalLM) -> AsyncIterator[TorchEngine]:
    e = TorchEngine(model, TOK, max_batch=4, max_seq_len=1024, device="cpu")
    await e.start()
    yield e
    await e.stop()


def cfg(**over: Any) -> ServeConfig:
    return ServeConfig(enabled=True, port=0, renderer="tags", default_max_tokens=6, **over)


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


async def post(url: str, body: dict[str, Any], key: str = "sk-a") -> tuple[int, dict[str, Any]]:
    async with (
        ClientSession() as http,
        http.post(
            url.removesuffix("/v1") + "/v1/feedback", json=body, headers={"Authorization": f"Bearer {key}"}
        ) as resp,
    ):
        return resp.status, await resp.json()


async def chat(client: openai.AsyncOpenAI, session: str, text: str, **kw: Any) -> Any:
    return await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": text}], extra_headers={"X-Session-ID": session}, **kw
    )


async def test_feedback_is_idempotent_released_once_and_then_too_late(engine: TorchEngine, tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    bus = await connect_bus(BusConfig(type="memory"), name="test")
    await bus.ensure_streams()
    raw_in = await bus.consumer("reward-model", Episode)
    c = cfg(group_size=1, api_keys=["sk-a"])
    pending = MemoryPending(pending_policy(c, "r"))
    ep = ServeEndpoint(
        engine,
        TOK,
        c,
        StoreSink(store, "r"),
        model_name=MODEL,
        run_id="r",
        pending=pending,
        store=store,
        bus=bus,
        release_every_s=0.05,
    )
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.base_url, api_key="sk-a")
    try:
        raw = await chat(client, "s1", "hello")
        resp, call_id = raw.parse(), raw.headers["x-slipstream-call-id"]
        assert resp.id == f"chatcmpl-{call_id}"
        body = {"completion_id": resp.id, "key": "accepted", "value": True}
        assert await post(ep.base_url, body) == (
            200,
            {"status": "recorded", "feedback_id": ANY, "episode_id": "serve/s1/0"},
        )
        # The same signal again, by the response id or the bare call id: recorded once.
        status, again = await post(ep.base_url, {**body, "completion_id": call_id})
        assert status == 200 and again["status"] == "duplicate"
        status, explicit = await post(
            ep.base_url, {"session_id": "s1", "key": "stars", "value": 4, "feedback_id": "f-9"}
        )
        assert (status, explicit["status"], explicit["feedback_id"]) == (200, "recorded", "f-9")
        assert (await post(ep.base_url, {"session_id": "s1", "key": "stars", "value": 1, "feedback_id": "f-9"}))[1][
            "status"
        ] == "duplicate"  # the id decides, not the value
        status, err = await post(ep.base_url, {"completion_id": "chatcmpl-nope", "key": "k", "value": 1})
        assert status == 404 and err["error"]["param"] == "completion_id"
        status, err = await post(ep.base_url, {"episode_id": "serve/s1/7", "key": "k", "value": 1})
        assert status == 404 and err["error"]["param"] == "episode_id"
        status, err = await post(ep.base_url, {"completion_id": call_id, "key": "k", "value": {"x": 1}})
        assert status == 400 and err["error"]["param"] == "value"
        assert (await post(ep.base_url, body, key="sk-wrong"))[0] == 401
        await ep.recorder.flush("s1")  # the session ends: its feedback is there, so it is released
        await until(lambda: _released(ep), 10, "the release")
        status, err = await post(ep.base_url, {"completion_id": call_id, "key": "edited", "value": True})
        assert status == 409 and err["error"]["code"] == "episode_released"
        assert (await post(ep.base_url, body))[1]["status"] == "duplicate"  # a retry after release is still 200
        (d,) = await raw_in.fetch(10, timeout=1.0)
        stub = d.msg
        assert stub.is_stub() and stub.episode_id == "serve/s1/0" and stub.group_id == "serve-r-1"
        full = load(store, stub)
        assert [(s.key, s.value) for s in full.feedback] == [("accepted", True), ("stars", 4.0)]
        assert full.samples[0].mask().count(1) == resp.usage.completion_tokens  # the body is kept intact
    finally:
        await client.close()
        await ep.close()
        await bus.close()


class _Any:
    def __eq__(self, other: object) -> bool:
        return isinstance(other, str) and bool(other)


ANY = _Any()


async def _released(ep: ServeEndpoint) -> bool:
    return ep.releaser is not None and ep.releaser.released >= 1


async def test_a_lagging_version_is_refused_with_429_and_the_client_retries(
    engine: TorchEngine, model: CausalLM
) -> None:
    newest = {"v": 3}
    ep = ServeEndpoint(
        engine,
        TOK,
        cfg(max_version_lag=1, retry_after_s=0.3),
        MemorySink(),
        model_name=MODEL,
        newest_version=lambda: newest["v"],
    )
    await ep.start()
    try:
        async with openai.AsyncOpenAI(base_url=ep.base_url, api_key="k", max_retries=0) as impatient:
            with pytest.raises(openai.RateLimitError) as err:
                await chat(impatient, "s", "hi")
        assert err.value.response.headers["retry-after-ms"] == "300" and err.value.code == "policy_version_lag"
        refused = ep.app.admission_refused

        async def catch_up() -> None:  # the promoted version reaches the learner's while the client waits
            await until(lambda: _more(ep, refused), 20, "a second refusal")
            engine.apply_weights(3, dict(model.state_dict()))

        job = asyncio.create_task(catch_up())
        async with openai.AsyncOpenAI(base_url=ep.base_url, api_key="k", max_retries=5) as patient:
            started = time.monotonic()
            raw = await chat(patient, "s", "hi")
        await job
        assert raw.headers[VERSION_HEADER] == "3" and raw.parse().usage.completion_tokens == 6
        assert ep.app.admission_refused >= refused + 1 and time.monotonic() - started >= 0.3
        assert ep.recorder.recorded == 1  # refused calls are never served nor recorded
    finally:
        await ep.close()


async def _more(ep: ServeEndpoint, n: int) -> bool:
    return ep.app.admission_refused > n


async def test_a_weight_update_during_a_streamed_completion_splits_its_versions(engine: TorchEngine) -> None:
    sink = MemorySink()
    ep = ServeEndpoint(engine, TOK, cfg(max_version_lag=0), sink, model_name=MODEL)
    await ep.start()
    new, _ = build_tiny("tiny", seed=1)
    n_tokens = 160
    try:
        async with openai.AsyncOpenAI(base_url=ep.base_url, api_key="k") as client:
            before = engine.stats()["tokens_generated"]
            request = asyncio.create_task(
                client.chat.completions.with_raw_response.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": "tell me a long story"}],
                    max_tokens=n_tokens,
                    temperature=0.0,
                    stream=True,
                    stream_options={"include_usage": True},
                    extra_body={"ignore_eos": True, "return_token_ids": True},
                    extra_headers={"X-Session-ID": "story"},
                )
            )

            async def decoding() -> bool:
                return engine.stats()["tokens_generated"] - before >= 10

            await until(decoding, 30, "the completion to be decoding")
            engine.apply_weights(1, dict(new.state_dict()))  # lands between two decode steps
            raw = await request
            chunks = [c async for c in raw.parse()]
        (record,) = ep.recorder.calls
        (v0, k), (v1, rest) = record.segments
        assert (v0, v1) == (0, 1) and k >= 10 and rest > 0 and k + rest == n_tokens, record.segments
        assert record.policy_versions == [0] * k + [1] * rest
        streamed = [c.model_extra["slipstream"] for c in chunks if c.model_extra and "slipstream" in c.model_extra]
        assert [tuple(s) for s in streamed[0]["policy_segments"]] == record.segments
        ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])]
        assert ids == record.completion_ids  # every token streamed, in order
        # Streamed live (slipstream.serve.live), the headers went out with the first token: they name
        # the version the stream started under; the final chunk's segments name every token's.
        assert raw.headers[VERSION_HEADER] == "0" and chunks[-1].usage.completion_tokens == n_tokens
        # The episode keeps the split: the policy tokens carry version 0 up to the update, 1 after it.
        episode = await ep.recorder.flush("story")
        assert episode is not None
        sample = episode.samples[0]
        versions = [v for seg in sample.segments for v in [seg.policy_version] * seg.n_tokens]
        assert versions == [0] * k + [1] * rest  # segments cover the tokens after the prompt
    finally:
        await ep.close()


async def test_feedback_through_either_replica_reaches_one_episode_and_is_scored_by_the_spec(
    engine: TorchEngine, nats_server: Any, redis_server: Any, tmp_path: Path
) -> None:
    from slipstream.reward_model.config import RewardModelConfig, RewardSection
    from slipstream.reward_model.service import RewardModelService
    from slipstream.runtime.section import ServiceSection
    from slipstream.store.config import StoreConfig

    run = "fb-run"
    store = LocalObjectStore(tmp_path / "store")
    bus_cfg = BusConfig(url=nats_server.url, stream_storage="memory", fetch_timeout_s=0.2)
    bus = await connect_bus(bus_cfg, name="endpoints")
    await bus.ensure_streams()
    spec = {
        "version": "e2e-v1",
        "components": [
            {"name": "accepted", "signal": "accepted", "map": {"true": 1.0, "false": 0.0}},
            {"name": "dissatisfied", "signal": "dissatisfied", "scale": -0.5, "source": "implicit"},
        ],
    }
    rm = RewardModelService(
        RewardModelConfig(
            service=ServiceSection(run_id=run, replica="rm0"),
            bus=bus_cfg,
            store=StoreConfig(root=str(tmp_path / "store")),
            reward=RewardSection(env_options={"serve": spec}),
        )
    )
    await rm.setup()
    stop = asyncio.Event()
    rm_task = asyncio.create_task(rm.run(stop))
    learner = await bus.consumer("learner", ScoredEpisode)
    c = cfg(group_size=2, feedback_deadline_s=60.0, reward_keys=["accepted", "dissatisfied"])
    replicas = []
    for _ in range(2):
        pending = RedisPending.connect(pending_policy(c, run), redis_server.url)
        replicas.append(
            ServeEndpoint(
                engine,
                TOK,
                c,
                StoreSink(store, run),
                model_name=MODEL,
                run_id=run,
                pending=pending,
                store=store,
                bus=bus,
                release_every_s=0.1,
            )
        )
    a, b = replicas
    for r in replicas:
        await r.start()
    try:
        async with (
            openai.AsyncOpenAI(base_url=a.base_url, api_key="k") as ca,
            openai.AsyncOpenAI(base_url=b.base_url, api_key="k") as cb,
        ):
            alice1 = (await chat(ca, "alice", "hi")).parse()
            alice2 = (await chat(ca, "alice", "No, that is wrong.")).parse()  # implicit signals for alice1
            await chat(cb, "bob", "hello")
            # Each posted to the replica that did NOT serve it.
            assert (await post(b.base_url, {"completion_id": alice2.id, "key": "accepted", "value": True}))[0] == 200
            assert (await post(a.base_url, {"session_id": "bob", "key": "accepted", "value": False}))[0] == 200
            assert (await post(a.base_url, {"session_id": "bob", "key": "accepted", "value": False}))[1][
                "status"
            ] == "duplicate"
        assert alice1.id != alice2.id
        await a.recorder.flush("alice")
        await b.recorder.flush("bob")
        got: list[ScoredEpisode] = []

        async def scored() -> bool:
            got.extend(d.msg for d in await learner.fetch(10, timeout=0.2))
            return len(got) >= 2

        await until(scored, 30, "both episodes scored")
        by_id = {s.episode.episode_id: s for s in got}
        assert set(by_id) == {"serve/alice/0", "serve/bob/0"}
        alice, bob_s = by_id["serve/alice/0"], by_id["serve/bob/0"]
        # alice: accepted (1.0) + an implicit dissatisfied follow-up on her first call (-0.5).
        assert alice.components == pytest.approx({"accepted": 1.0, "dissatisfied": -0.5}) and alice.reward == 0.5
        assert bob_s.components == {"accepted": 0.0} and bob_s.reward == 0.0
        assert alice.scorer_version.startswith("serve@1/e2e-v1+")
        assert {s.episode.group_id for s in got} == {f"serve-{run}-1"} and {s.episode.group_size for s in got} == {2}
        body = load_scored(store, alice).episode
        keys = sorted((s.key, s.source) for s in body.feedback)
        assert keys == [("accepted", "user"), ("dissatisfied", "implicit"), ("followed_up", "implicit")]
        assert body.counts["calls"] == 2 and body.group_id == f"serve-{run}-1"

        async def both_marked() -> bool:  # one release per episode, whichever replica formed the group
            return sum(r.releaser.released for r in replicas if r.releaser is not None) == 2

        await until(both_marked, 10, "both releases to be marked")
    finally:
        for r in replicas:
            await r.close()
        stop.set()
        await asyncio.wait_for(rm_task, 10)
        await rm.close()
        await bus.close()


class DiesAfterPublish(MemoryPending):
    """A releaser that dies after JetStream acked the stub, before the release is recorded (fault injection)."""

    deaths = 1

    async def released(self, episode_id: str) -> None:
        if self.deaths:
            self.deaths -= 1
            raise ConnectionError("the releaser died here")
        await super().released(episode_id)


async def test_a_release_interrupted_after_its_publish_is_stored_once(nats_server: Any, tmp_path: Path) -> None:
    from slipstream.schemas import FeedbackSignal, encode
    from slipstream.serve import PendingPolicy, Releaser
    from slipstream.store.episodes import episode_key

    store = LocalObjectStore(tmp_path / "store")
    bus = await connect_bus(BusConfig(url=nats_server.url, stream_storage="memory", fetch_timeout_s=0.2), name="t")
    await bus.ensure_streams()
    raw_in = await bus.consumer("reward-model", Episode)
    pending = DiesAfterPublish(PendingPolicy(env="serve", run_id="r", group_size=1))
    eid = "serve/s/0"
    key = episode_key("r", eid)
    store.put(key, encode(Episode(episode_id=eid, task_id=eid, env="serve", run_id="r")))
    await pending.note_call("c", "s", eid)
    await pending.add_feedback(eid, FeedbackSignal(key="accepted", value=True, feedback_id="f"), 1.0)
    await pending.flushed(eid, key, deadline=1e12, now=1.0)
    try:
        first = Releaser(pending, store, bus, stale_after_s=0.0)
        assert await first.step() == 0 and first.failures == 1  # published, then died before marking it
        assert await pending.state(eid) == "releasing"
        restarted = Releaser(pending, store, bus, stale_after_s=0.0)
        assert await restarted.step() == 1 and await pending.state(eid) == "released"
        assert await restarted.step() == 0
        got = await raw_in.fetch(10, timeout=1.0)
        assert [d.msg.episode_id for d in got] == [eid]  # the same bytes under msg_id = episode id: stored once
        for d in got:
            await d.ack()
        assert await raw_in.fetch(10, timeout=0.5) == []
        assert [s.feedback_id for s in load(store, got[0].msg).feedback] == ["f"]
    finally:
        await bus.close()


async def test_a_serving_worker_publishes_a_session_with_its_feedback(
    nats_server: Any, redis_server: Any, tmp_path: Path
) -> None:
    from slipstream.engine.source import ModelSource
    from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
    from slipstream.rollout_worker.service import RolloutWorkerService
    from slipstream.runtime.lifecycle import Runtime
    from slipstream.runtime.section import ServiceSection
    from slipstream.store import StoreConfig

    bus_cfg = BusConfig(url=nats_server.url, stream_storage="memory", fetch_timeout_s=0.2)
    cfg = RolloutWorkerConfig(
        service=ServiceSection(run_id="srv", replica="w0", drain_timeout_s=5.0, redis_url=redis_server.url),
        bus=bus_cfg,
        store=StoreConfig(type="local", root=str(tmp_path / "store")),
        model=ModelSource(preset="tiny", seed=0, threads=1),
        worker=WorkerSection(max_batch=4, max_tasks_in_flight=1, follow="promoted"),
        endpoint=cfg_worker(),
    )
    bus = await connect_bus(bus_cfg, name="test")
    await bus.ensure_streams()
    raw_in = await bus.consumer("reward-model", Episode)
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    try:

        async def ready() -> bool:
            return runtime.readiness()[0]

        await until(ready, 60, "the worker")
        assert service.endpoint is not None
        async with openai.AsyncOpenAI(base_url=service.endpoint.base_url, api_key="k") as client:
            resp = (await chat(client, "w-sess", "hi")).parse()
        status, body = await post(service.endpoint.base_url, {"completion_id": resp.id, "key": "accepted", "value": 1})
        assert status == 200 and body["episode_id"] == "serve/w-sess/0"
        got: list[Episode] = []

        async def published() -> bool:  # the session goes idle, is flushed, released and published
            got.extend(d.msg for d in await raw_in.fetch(10, timeout=0.2))
            return bool(got)

        await until(published, 30, "the released episode on traj.raw.serve")
        (stub,) = got
        assert stub.is_stub() and stub.episode_id == "serve/w-sess/0" and stub.group_id == "serve-srv-1"
        assert [(s.key, s.value) for s in stub.feedback] == [("accepted", 1.0)]

        async def counted() -> bool:  # marked released just after JetStream acked the publish
            return bool(runtime.readiness()[1]["status"]["serve"]["episodes_released"] == 1)

        await until(counted, 10, "the release to be counted")
        assert runtime.readiness()[1]["status"]["serve"]["admission_refused"] == 0
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
        await bus.close()
    assert code == 0


def cfg_worker() -> ServeConfig:
    return cfg(group_size=1, session_idle_s=0.3)
