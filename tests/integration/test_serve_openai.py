"""The OpenAI-compatible endpoint driven by the real `openai` client over a loopback socket.

A real TorchEngine (the tiny byte-level preset, served with the `tags` renderer that byte-level
models use) serves the calls; `RecordingEngine` keeps what the engine returned for each request,
and every recorded call must equal it: ids and log-probs are never rebuilt from text. A random
tiny model never writes a tool call (and overfitting one took minutes on the shared CI cores),
so the tool-call test alone serves through the harness's `ScriptedEngine`, the engine the
environments' scripted experts use, which answers with the call as the model family writes it.

Retries are made real: a middleware lets the first attempt be served and recorded, then answers
503 instead of its response, so the client retries with `x-stainless-retry-count: 1` and the
same body, which must be replayed and recorded once.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from aiohttp import ClientSession, web

from slipstream.engine import CausalLM, GenerationRequest, TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.harness.provenance import RecordingEngine
from slipstream.schemas import Episode, decode
from slipstream.serve import VERSION_HEADER, MemorySink, ServeConfig, ServeEndpoint, StoreSink
from slipstream.store import LocalObjectStore
from slipstream.supervised.scripted import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOK = ByteTokenizer()
MODEL = "slipstream-tiny"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_PROMPT = [{"role": "user", "content": "Weather in Paris?"}]
TOOL_REPLY = '<tool>{"name": "get_weather", "args": {"city": "Paris"}}</tool>'


@pytest.fixture(scope="module")
def model() -> CausalLM:
    torch.set_num_threads(1)
    m, _ = build_tiny("tiny", seed=0)
    return m


class FailFirst:
    """Serve the first chat call for real, then lose its response (503): the SDK must retry."""

    def __init__(self) -> None:
        self.failed = 0

    @web.middleware
    async def middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        resp = await handler(request)
        if request.path.endswith("/chat/completions") and self.failed == 0:
            self.failed += 1
            return web.json_response({"error": {"message": "lost", "type": "server_error"}}, status=503)
        return resp


@pytest.fixture
async def served(request: pytest.FixtureRequest, model: CausalLM) -> AsyncIterator[dict[str, Any]]:
    if getattr(request, "param", "torch") == "scripted":
        inner: Any = ScriptedEngine(TOK, lambda req, prompt: TOOL_REPLY if "Paris" in prompt else "no idea</tool>")
    else:
        inner = TorchEngine(model, TOK, max_batch=8, max_seq_len=1024, device="cpu")
    engine = RecordingEngine(inner)
    await engine.start()
    sink = MemorySink()
    fail = FailFirst()
    fail.failed = 1  # off unless a test arms it
    cfg = ServeConfig(enabled=True, port=0, renderer="tags", default_max_tokens=16)
    ep = ServeEndpoint(engine, TOK, cfg, sink, model_name=MODEL, middlewares=[fail.middleware])
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.base_url, api_key="sk-session-a", max_retries=2)
    try:
        yield {"ep": ep, "engine": engine, "sink": sink, "client": client, "fail": fail}
    finally:
        await client.close()
        await ep.close()
        await engine.stop()


def _engine_call(engine: RecordingEngine, call_id: str) -> Any:
    (found,) = [c for c in engine.calls if c.request_id == call_id]
    return found


async def test_chat_non_streaming_records_what_the_engine_produced(served: dict[str, Any]) -> None:
    client, ep, engine = served["client"], served["ep"], served["engine"]
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=12,
        seed=7,
        logprobs=True,
        extra_body={"return_token_ids": True},
    )
    resp = raw.parse()
    (record,) = ep.recorder.calls
    produced = _engine_call(engine, record.call_id)
    assert record.prompt_ids == list(produced.prompt_ids)
    assert record.completion_ids == list(produced.completion_ids)
    assert record.logprobs == list(produced.logprobs)
    assert len(record.completion_ids) == resp.usage.completion_tokens == 12
    assert resp.usage.prompt_tokens == len(record.prompt_ids)
    assert resp.choices[0].finish_reason == "length"
    assert [c.logprob for c in resp.choices[0].logprobs.content] == pytest.approx(record.logprobs)
    extra = resp.model_extra or {}
    assert extra["prompt_token_ids"] == record.prompt_ids
    assert resp.choices[0].model_extra["token_ids"] == record.completion_ids
    assert raw.headers[VERSION_HEADER] == "0" and record.segments == [(0, 12)]
    assert record.params.seed == 7 and record.params.max_tokens == 12
    assert record.template_hash == ep.fmt.template_hash and len(record.template_hash) == 64
    assert record.session_id.startswith("key-")  # the bearer key names the session
    # The same request in-process (same prompt ids and seed) gives the same tokens.
    again = await engine.generate(
        GenerationRequest(request_id="again", prompt_ids=record.prompt_ids, params=record.params)
    )
    assert again.completion_ids == record.completion_ids and again.logprobs == pytest.approx(record.logprobs)


async def test_streaming_with_usage_matches_the_record(served: dict[str, Any]) -> None:
    client, ep = served["client"], served["ep"]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream me"}],
        max_tokens=10,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    (record,) = ep.recorder.calls
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(record.completion_ids) == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert text == TOK.decode(record.completion_ids)
    # Not streamed, same seed: the same completion.
    plain = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "stream me"}], max_tokens=10, seed=3
    )
    assert plain.choices[0].message.content == text


@pytest.mark.parametrize("served", ["scripted"], indirect=True)
async def test_tool_call_is_parsed_into_openai_tool_calls(served: dict[str, Any]) -> None:
    client, ep = served["client"], served["ep"]
    resp = await client.chat.completions.create(
        model=MODEL, messages=TOOL_PROMPT, tools=[WEATHER], temperature=0, max_tokens=120
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    (record,) = ep.recorder.calls
    assert TOK.decode(record.completion_ids) == TOOL_REPLY  # the ids as generated, stop string included
    assert record.completion_ids == list(_engine_call(served["engine"], record.call_id).completion_ids)
    # Streamed, the same call arrives as a tool_calls delta.
    stream = await client.chat.completions.create(
        model=MODEL, messages=TOOL_PROMPT, tools=[WEATHER], temperature=0, max_tokens=120, stream=True
    )
    deltas = [c.choices[0].delta for c in [c async for c in stream] if c.choices]
    streamed = [tc for d in deltas for tc in d.tool_calls or []]
    assert [(t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        ("get_weather", {"city": "Paris"})
    ]


def _member_episodes(served: dict[str, Any], sessions: list[str]) -> list[Episode]:
    """The episodes recorded for a group's member sessions, in member order."""
    by_session = {e.metadata["session_id"]: e for e in served["sink"].episodes}
    return [by_session[s] for s in sessions]


def _assert_served_as_recorded(served: dict[str, Any], episode: Episode, call_id: str, ids: list[int]) -> None:
    """One member: the ids the client got are the engine's, and its episode holds exactly them."""
    produced = _engine_call(served["engine"], call_id)
    assert ids == list(produced.completion_ids)
    (sample,) = episode.samples
    assert sample.ids() == list(produced.prompt_ids) + ids and sample.prompt_len == len(produced.prompt_ids)
    assert sample.mask() == [1] * len(ids)
    assert sample.behaviour_logprobs() == pytest.approx(list(produced.logprobs))


async def test_chat_n_2_answers_two_choices_each_recorded_as_its_own_episode(served: dict[str, Any]) -> None:
    client, ep = served["client"], served["ep"]
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "pick one"}], "max_tokens": 10, "seed": 5}
    raw = await client.chat.completions.with_raw_response.create(
        **ask, n=2, logprobs=True, extra_body={"return_token_ids": True}
    )
    resp = raw.parse()
    assert [c.index for c in resp.choices] == [0, 1]
    extra = resp.model_extra or {}
    call_ids, sessions = extra["slipstream"]["call_ids"], extra["slipstream"]["session_ids"]
    assert len(set(sessions)) == 2 and len(served["engine"].calls) == ep.recorder.recorded == 2
    ids = [c.model_extra["token_ids"] for c in resp.choices]
    assert ids[0] != ids[1]  # seeds 5 and 6: two draws, not one draw twice
    assert resp.usage.completion_tokens == len(ids[0]) + len(ids[1])
    assert [c.model_extra["slipstream"]["call_id"] for c in resp.choices] == call_ids
    for choice, call_id in zip(resp.choices, call_ids, strict=True):
        produced = _engine_call(served["engine"], call_id)
        assert [e.logprob for e in choice.logprobs.content] == pytest.approx(list(produced.logprobs))
        assert extra["prompt_token_ids"] == list(produced.prompt_ids)
    # One call with the same seed and n = 1 is member 0's draw.
    single = await client.chat.completions.create(**ask, extra_body={"return_token_ids": True})
    assert single.choices[0].model_extra["token_ids"] == ids[0]
    await ep.recorder.flush_all()
    episodes = _member_episodes(served, sessions)
    for episode, call_id, member_ids in zip(episodes, call_ids, ids, strict=True):
        _assert_served_as_recorded(served, episode, call_id, member_ids)
        assert episode.metadata["group_key"] == raw.headers["x-slipstream-group"]
        assert episode.metadata["group_size"] == "2"
    assert len(served["sink"].episodes) == 3  # the two members and the single call
    # The same key asks again: a fresh pair of sessions, never folded into the first pair's episodes.
    again = await client.chat.completions.create(**ask, n=2)
    assert not set((again.model_extra or {})["slipstream"]["session_ids"]) & set(sessions)


async def test_chat_n_2_streamed_sends_each_choice_under_its_index(served: dict[str, Any]) -> None:
    client, ep = served["client"], served["ep"]
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "two streams"}], "max_tokens": 8, "seed": 9}
    stream = await client.chat.completions.create(
        **ask, n=2, stream=True, stream_options={"include_usage": True}, extra_body={"return_token_ids": True}
    )
    chunks = [c async for c in stream]
    ids: dict[int, list[int]] = {0: [], 1: []}
    text: dict[int, str] = {0: "", 1: ""}
    ends: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            ids[choice.index] += (choice.model_extra or {}).get("token_ids") or []
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                ends[choice.index] = (chunk.model_extra or {})["slipstream"]
    assert sorted(ends) == [0, 1] and ends[0]["session_id"] != ends[1]["session_id"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(ids[0]) + len(ids[1])
    # Not streamed, the same seed: the same two draws, in the same order.
    plain = await client.chat.completions.create(**ask, n=2, extra_body={"return_token_ids": True})
    assert [c.model_extra["token_ids"] for c in plain.choices] == [ids[0], ids[1]]
    assert [c.message.content for c in plain.choices] == [text[0], text[1]]
    await ep.recorder.flush_all()
    sessions = [ends[0]["session_id"], ends[1]["session_id"]]
    for i, episode in enumerate(_member_episodes(served, sessions)):
        _assert_served_as_recorded(served, episode, ends[i]["call_id"], ids[i])


async def test_completions_n_2_answers_two_choices_each_recorded_as_its_own_episode(served: dict[str, Any]) -> None:
    client, ep = served["client"], served["ep"]
    resp = await client.completions.create(
        model=MODEL, prompt="7*6=", max_tokens=6, n=2, seed=2, extra_body={"return_token_ids": True}
    )
    assert [c.index for c in resp.choices] == [0, 1]
    call_ids = (resp.model_extra or {})["slipstream"]["call_ids"]
    sessions = (resp.model_extra or {})["slipstream"]["session_ids"]
    await ep.recorder.flush_all()
    for choice, episode, call_id in zip(resp.choices, _member_episodes(served, sessions), call_ids, strict=True):
        _assert_served_as_recorded(served, episode, call_id, choice.model_extra["token_ids"])
    assert len(served["sink"].episodes) == 2


async def test_a_retried_request_is_replayed_and_recorded_once(served: dict[str, Any]) -> None:
    client, ep, engine = served["client"], served["ep"], served["engine"]
    served["fail"].failed = 0  # arm: the first attempt is served, then its response is lost
    raw = await client.chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "retry me"}], max_tokens=8
    )
    resp = raw.parse()
    assert served["fail"].failed == 1
    assert raw.retries_taken == 1 and raw.headers["x-slipstream-replayed"] == "true"
    assert ep.recorder.recorded == 1 and len(engine.calls) == 1  # generated once, recorded once
    (record,) = ep.recorder.calls
    assert resp.id == f"chatcmpl-{record.call_id}"
    assert resp.choices[0].message.content == TOK.decode(record.completion_ids)
    # The same body sent again as a first attempt is a new call (a user may ask twice).
    await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "retry me"}], max_tokens=8)
    assert ep.recorder.recorded == 2
    # An idempotency key coalesces whatever the retry count.
    for _ in range(2):
        await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "once"}],
            max_tokens=4,
            extra_headers={"Idempotency-Key": "k-1"},
        )
    assert ep.recorder.recorded == 3 and ep.recorder.coalesced == 2
    # Without any session identity (no key, no header) a retry still finds its first attempt.
    body = {"model": MODEL, "messages": [{"role": "user", "content": "anon"}], "max_tokens": 3}
    url = ep.base_url + "/chat/completions"
    async with ClientSession() as http:
        async with http.post(url, json=body) as first:
            assert first.status == 200 and first.headers["x-slipstream-replayed"] == "false"
            first_id = (await first.json())["id"]
        async with http.post(url, json=body, headers={"x-stainless-retry-count": "1"}) as again:
            assert again.headers["x-slipstream-replayed"] == "true" and (await again.json())["id"] == first_id
        async with http.get(ep.base_url + "/nothing") as missing:
            assert missing.status == 404 and (await missing.json())["error"]["type"] == "not_found_error"
    assert ep.recorder.recorded == 4


async def test_sessions_assemble_into_episodes(served: dict[str, Any], tmp_path: Path) -> None:
    client, ep = served["client"], served["ep"]
    hdr = {"X-Session-ID": "sess-1"}
    # Tokens in: the client continues exactly what it was served, plus a turn of its own.
    first = await client.completions.create(
        model=MODEL, prompt="Q: 2+2?", max_tokens=6, seed=1, extra_headers=hdr, extra_body={"return_token_ids": True}
    )
    c1_ids = first.choices[0].model_extra["token_ids"]
    (c1,) = ep.recorder.session_calls("sess-1")
    follow = [*c1.prompt_ids, *c1_ids, *TOK.encode("\nQ: and 3+3?")]
    await client.completions.create(model=MODEL, prompt=follow, max_tokens=5, seed=2, extra_headers=hdr)
    # A chat call renders a different prompt: it cannot extend the sample, a new one starts.
    await client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Q: 2+2?"}], max_tokens=4, extra_headers=hdr
    )
    c1, c2, c3 = ep.recorder.session_calls("sess-1")
    episode = await ep.recorder.flush("sess-1")
    assert episode is not None and served["sink"].episodes == [episode]
    root, branch = episode.samples
    obs = c2.prompt_ids[len(c1.prompt_ids) + len(c1.completion_ids) :]
    assert obs == TOK.encode("\nQ: and 3+3?")
    assert root.ids() == c2.prompt_ids + c2.completion_ids and root.prompt_len == len(c1.prompt_ids)
    assert root.mask() == [1] * len(c1.completion_ids) + [0] * len(obs) + [1] * len(c2.completion_ids)
    assert root.behaviour_logprobs() == pytest.approx(c1.logprobs + [0.0] * len(obs) + c2.logprobs)
    assert sum(s.n_tokens for s in root.segments) == len(root.mask())
    assert branch.branch_of == root.sample_id and branch.ids() == c3.prompt_ids + c3.completion_ids
    diverge = next(i for i, (a, b) in enumerate(zip(root.ids(), c3.prompt_ids, strict=False)) if a != b)
    assert branch.branch_pos == diverge
    assert episode.metadata["session_id"] == "sess-1" and episode.counts["calls"] == 3
    # What the last call asked (its last user message) is kept as the task a judge is shown.
    assert c1.task_text == "Q: 2+2?" and c2.task_text == "" and episode.metadata["prompt"] == "Q: 2+2?"
    # The store sink writes the body where the by-reference layout reads it.
    store = LocalObjectStore(tmp_path / "store")
    await StoreSink(store, "run-1").put(episode)
    assert decode(store.get(f"run-1/episodes/{episode.episode_id}.msgpack"), Episode) == episode


async def test_completions_models_health_and_versions(served: dict[str, Any]) -> None:
    client, ep, engine = served["client"], served["ep"], served["engine"]
    assert [m.id for m in (await client.models.list()).data] == [MODEL]
    resp = await client.completions.create(
        model=MODEL, prompt="12+30=", max_tokens=6, seed=5, logprobs=1, extra_body={"return_token_ids": True}
    )
    (record,) = ep.recorder.calls
    produced = _engine_call(engine, record.call_id)
    assert record.prompt_ids == [TOK.BOS, *TOK.encode("12+30=")] == list(produced.prompt_ids)
    assert resp.choices[0].model_extra["token_ids"] == record.completion_ids == list(produced.completion_ids)
    assert resp.choices[0].logprobs.token_logprobs == pytest.approx(list(produced.logprobs))
    stream = await client.completions.create(
        model=MODEL, prompt="12+30=", max_tokens=6, seed=5, stream=True, stream_options={"include_usage": True}
    )
    chunks = [c async for c in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    # Token ids in; a new policy version is named in the header and in the record's segments.
    engine.inner.apply_weights(3, {k: v.clone() for k, v in engine.state_dict().items()})
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt=[TOK.BOS, 49, 50], max_tokens=4)
    assert raw.headers[VERSION_HEADER] == "3" and ep.recorder.calls[-1].segments == [(3, 4)]
    async with ClientSession() as http, http.get(ep.base_url.removesuffix("/v1") + "/health") as health:
        assert health.status == 200 and (await health.json())["policy_version"] == 3


@pytest.mark.parametrize(
    ("kwargs", "error", "param"),
    [
        ({"model": "gpt-4o", "messages": [{"role": "user", "content": "x"}]}, openai.NotFoundError, "model"),
        ({"model": MODEL, "messages": []}, openai.BadRequestError, "messages"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 65}, openai.BadRequestError, "n"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, openai.BadRequestError, "messages[0]"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            openai.BadRequestError,
            "max_tokens",
        ),
    ],
)
async def test_bad_requests_get_openai_errors_naming_the_field(
    served: dict[str, Any], kwargs: dict[str, Any], error: type[Exception], param: str
) -> None:
    with pytest.raises(error) as info:
        await served["client"].chat.completions.create(**kwargs)
    assert info.value.param == param  # type: ignore[attr-defined]
    assert param.split("[")[0] in str(info.value)
    assert served["ep"].recorder.recorded == 0


async def test_continue_final_message_leaves_the_assistant_prefix_open() -> None:
    """vLLM's `continue_final_message`: the ChatML prompt ends with the assistant turn opened and
    its text (a verdict prefill), no end of turn; the completion continues it."""
    engine = RecordingEngine(ScriptedEngine(TOK, lambda req, prompt: " 7"))
    await engine.start()
    cfg = ServeConfig(enabled=True, port=0, renderer="smollm2", default_max_tokens=4)
    ep = ServeEndpoint(engine, TOK, cfg, MemorySink(), model_name=MODEL)
    await ep.start()
    client = openai.AsyncOpenAI(base_url=ep.base_url, api_key="sk-judge", max_retries=0)
    convo = [{"role": "user", "content": "Score it."}, {"role": "assistant", "content": "SCORE:"}]
    try:
        resp = await client.chat.completions.create(
            model=MODEL, messages=convo, extra_body={"continue_final_message": True, "return_token_ids": True}
        )
        ids = (resp.model_extra or {})["prompt_token_ids"]
        opened = TOK.encode("<|im_start|>user\nScore it.<|im_end|>\n<|im_start|>assistant\nSCORE:")
        assert ids[-len(opened) :] == opened  # the prompt ends with the prefix: no end of turn after it
        assert TOK.decode(ids).count("<|im_end|>") == 2  # the system and user turns only
        assert resp.choices[0].message.content == " 7" and ep.recorder.calls[-1].prompt_ids == ids
        # Without the extra the assistant message is a closed turn and a new one is opened.
        plain = await client.chat.completions.create(model=MODEL, messages=convo, extra_body={"return_token_ids": True})
        assert TOK.decode((plain.model_extra or {})["prompt_token_ids"]).endswith(
            "SCORE:<|im_end|>\n<|im_start|>assistant\n"
        )
        # vLLM's explicit form (what libs/judge sends) renders the same prompt.
        both = {"continue_final_message": True, "add_generation_prompt": False, "return_token_ids": True}
        again = await client.chat.completions.create(model=MODEL, messages=convo, extra_body=both)
        assert (again.model_extra or {})["prompt_token_ids"] == ids
        # Refused, naming the field: nothing to continue, or a generation prompt asked for too.
        for messages, extra, why in (
            (convo[:1], {"continue_final_message": True}, "messages[0] has role 'user'"),
            (convo, {"continue_final_message": True, "add_generation_prompt": True}, "cannot both be true"),
        ):
            with pytest.raises(openai.BadRequestError) as info:
                await client.chat.completions.create(model=MODEL, messages=messages, extra_body=extra)
            assert info.value.param == "continue_final_message" and why in str(info.value)  # type: ignore[attr-defined]
        assert ep.recorder.recorded == 3
    finally:
        await client.close()
        await ep.close()
        await engine.stop()


async def test_concurrent_sessions_share_the_engine(served: dict[str, Any]) -> None:
    client, ep = served["client"], served["ep"]
    results = await asyncio.gather(
        *(
            client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"q{i}"}],
                max_tokens=5,
                extra_headers={"X-Session-ID": f"s{i}"},
            )
            for i in range(6)
        )
    )
    assert len(results) == 6 and ep.recorder.recorded == 6
    assert await ep.recorder.flush_all() == 6 and len(served["sink"].episodes) == 6


async def test_a_serving_worker_opens_the_endpoint_and_stores_sessions(nats_server: Any, tmp_path: Path) -> None:
    from slipstream.bus import BusConfig
    from slipstream.engine.source import ModelSource
    from slipstream.rollout_worker.config import RolloutWorkerConfig, WorkerSection
    from slipstream.rollout_worker.service import RolloutWorkerService
    from slipstream.runtime.lifecycle import Runtime
    from slipstream.runtime.section import ServiceSection
    from slipstream.store import StoreConfig

    cfg = RolloutWorkerConfig(
        service=ServiceSection(run_id="srv", replica="w0", drain_timeout_s=5.0),
        bus=BusConfig(url=nats_server.url, stream_storage="memory", fetch_timeout_s=0.2),
        store=StoreConfig(type="local", root=str(tmp_path / "store")),
        model=ModelSource(preset="tiny", seed=0, threads=1),
        worker=WorkerSection(max_batch=4, max_tasks_in_flight=1, follow="promoted"),
        endpoint=ServeConfig(enabled=True, port=0, renderer="tags", api_keys=["sk-good"]),
    )
    service = RolloutWorkerService(cfg)
    runtime = Runtime(service, cfg.service)
    running = asyncio.create_task(runtime.run(handle_signals=False))
    try:
        for _ in range(600):
            if runtime.readiness()[0]:
                break
            await asyncio.sleep(0.1)
        assert service.endpoint is not None and service.endpoint.model_name == "slipstream-tiny"
        client = openai.AsyncOpenAI(base_url=service.endpoint.base_url, api_key="sk-good")
        raw = await client.chat.completions.with_raw_response.create(
            model="slipstream-tiny",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            extra_headers={"X-Session-ID": "w-sess"},
        )
        assert raw.headers[VERSION_HEADER] == "0" and raw.parse().usage.completion_tokens == 5
        async with openai.AsyncOpenAI(base_url=service.endpoint.base_url, api_key="sk-bad", max_retries=0) as bad:
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        assert runtime.readiness()[1]["status"]["serve"]["calls_recorded"] == 1
        await client.close()
    finally:
        runtime.request_stop("test")
        code = await asyncio.wait_for(running, 30.0)
    assert code == 0
    # Shutdown flushed the open session into the store as an episode.
    body = LocalObjectStore(tmp_path / "store").get("srv/episodes/serve/w-sess/0.msgpack")
    episode = decode(body, Episode)
    assert episode.metadata["session_id"] == "w-sess" and episode.samples[0].mask() == [1] * 5
    assert episode.worker_id == "rollout-worker/w0" and episode.env == "serve"
