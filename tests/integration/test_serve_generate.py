"""vLLM's `/inference/v1/generate` route on the recording endpoint, driven over a loopback socket.

A real TorchEngine (the tiny byte-level preset) serves; `RecordingEngine` keeps what it returned
for every request. A client that renders prompts itself sends token ids with a per-rollout
`X-Session-ID`, and reads back the sampled ids and log-probs: they must equal what the engine
produced, the endpoint must record exactly them, and a second turn whose prompt extends the
first call's context must join the same sample (new prompt tokens at mask 0). `renderers`'
`generate()` (the function verifiers' training client calls), run in verifiers' own venv, reads
the route and gets back exactly what was recorded. Two `n` = 2 calls sent at once and rated
interleaved are released (real Redis, real nats-server) as one group per prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from aiohttp import ClientSession

from slipstream.engine import CausalLM, TorchEngine, build_tiny
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.harness.provenance import RecordingEngine
from slipstream.serve import MemorySink, ServeConfig, ServeEndpoint

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TOK = ByteTokenizer()
MODEL = "slipstream-tiny"


@pytest.fixture(scope="module")
def model() -> CausalLM:
    torch.set_num_threads(1)
    m, _ = build_tiny("tiny", seed=0)
    return m


@pytest.fixture
async def served(model: CausalLM) -> AsyncIterator[dict[str, Any]]:
    engine = RecordingEngine(TorchEngine(model, TOK, max_batch=8, max_seq_len=1024, device="cpu"))
    await engine.start()
    sink = MemorySink()
    cfg = ServeConfig(enabled=True, port=0, renderer="tags", default_max_tokens=16, session_idle_s=3600)
    ep = ServeEndpoint(engine, TOK, cfg, sink, model_name=MODEL)
    await ep.start()
    http = ClientSession()
    try:
        yield {"ep": ep, "engine": engine, "sink": sink, "http": http}
    finally:
        await http.close()
        await ep.close()
        await engine.stop()


def _root(ep: ServeEndpoint) -> str:
    return ep.base_url.removesuffix("/v1")


async def _generate(
    served: dict[str, Any], body: dict[str, Any], session: str | None
) -> tuple[int, dict[str, Any], Any]:
    headers = {"X-Session-ID": session} if session else {}
    async with served["http"].post(f"{_root(served['ep'])}/inference/v1/generate", json=body, headers=headers) as resp:
        return resp.status, await resp.json(), resp.headers


async def test_token_ids_in_exact_ids_and_logprobs_out_recorded_per_session(served: dict[str, Any]) -> None:
    ep, engine, sink = served["ep"], served["engine"], served["sink"]
    prompt = [TOK.bos_id, *TOK.encode("User: add 2 and 3\nAssistant:")]
    body = {
        "model": MODEL,
        "token_ids": prompt,
        "sampling_params": {
            "max_tokens": 10,
            "temperature": 1.0,
            "seed": 3,
            "logprobs": 1,
            "top_k": -1,
            "stop_token_ids": [TOK.eos_id],
            "skip_special_tokens": False,
        },
    }
    status, first, headers = await _generate(served, body, "rollout-a")
    assert status == 200, first
    (choice,) = first["choices"]
    (call,) = [c for c in engine.calls if c.request_id == first["slipstream"]["call_ids"][0]]
    assert first["prompt_token_ids"] == prompt == list(call.prompt_ids)
    assert choice["token_ids"] == list(call.completion_ids) and len(choice["token_ids"]) >= 1
    assert [e["logprob"] for e in choice["logprobs"]["content"]] == list(call.logprobs)
    assert [e["token"] for e in choice["logprobs"]["content"]] == [f"token_id:{t}" for t in call.completion_ids]
    assert headers["x-slipstream-session-id"] == "rollout-a"

    # Turn 2 of the same rollout: the client appends a tool result to the exact context it holds.
    observation = TOK.encode("\nTool: 5\nAssistant:")
    body2 = {**body, "token_ids": [*prompt, *choice["token_ids"], *observation]}
    status, second, _ = await _generate(served, body2, "rollout-a")
    assert status == 200, second
    # Another rollout: its own session, its own episode.
    status, other, _ = await _generate(served, {**body, "sampling_params": {"max_tokens": 4}}, "rollout-b")
    assert status == 200, other

    await ep.recorder.flush_all()
    by_session = {e.metadata["session_id"]: e for e in sink.episodes}
    assert set(by_session) == {"rollout-a", "rollout-b"}
    (sample,) = by_session["rollout-a"].samples  # turn 2 extended turn 1's sample
    ids, mask, lps = sample.ids(), sample.mask(), sample.behaviour_logprobs()
    n = sample.prompt_len
    assert ids[:n] == prompt
    c1, c2 = choice["token_ids"], second["choices"][0]["token_ids"]
    assert ids[n:] == [*c1, *observation, *c2]
    assert mask == [1] * len(c1) + [0] * len(observation) + [1] * len(c2)
    sampled = [lp for lp, m in zip(lps, mask, strict=True) if m]
    assert sampled == [e["logprob"] for e in choice["logprobs"]["content"]] + [
        e["logprob"] for e in second["choices"][0]["logprobs"]["content"]
    ]


async def test_bad_fields_are_refused_naming_them(served: dict[str, Any]) -> None:
    prompt = [TOK.bos_id, *TOK.encode("hi")]
    cases = [
        ({"model": MODEL, "token_ids": []}, "token_ids"),
        ({"model": MODEL, "token_ids": [10**9]}, "token_ids"),
        ({"model": "other", "token_ids": prompt}, "model"),
        ({"model": MODEL, "token_ids": prompt, "sampling_params": {"presence_penalty": 0.5}}, "presence_penalty"),
        ({"model": MODEL, "token_ids": prompt, "sampling_params": {"beam_width": 2}}, "sampling_params"),
        ({"model": MODEL, "token_ids": prompt, "sampling_params": {"max_tokens": 0}}, "max_tokens"),
    ]
    for body, param in cases:
        status, out, _ = await _generate(served, body, "s")
        assert status in (400, 404), (body, out)
        assert out["error"]["param"] == param, (body, out)
    assert list(served["ep"].recorder.calls) == []


async def test_a_malformed_group_header_is_refused_naming_it(served: dict[str, Any]) -> None:
    body = {"model": MODEL, "token_ids": [TOK.bos_id, *TOK.encode("hi")], "sampling_params": {"max_tokens": 2}}
    url = f"{_root(served['ep'])}/inference/v1/generate"
    cases = [
        ({"x-slipstream-group": "g", "x-slipstream-group-size": "0"}, "x-slipstream-group-size"),
        ({"x-slipstream-group": "g", "x-slipstream-group-size": "two"}, "x-slipstream-group-size"),
        ({"x-slipstream-group-size": "2"}, "x-slipstream-group-size"),
        ({"x-slipstream-group": "g" * 300}, "x-slipstream-group"),
    ]
    for headers, param in cases:
        async with served["http"].post(url, json=body, headers=headers) as resp:
            out = await resp.json()
            assert resp.status == 400 and out["error"]["param"] == param, (headers, out)
    assert list(served["ep"].recorder.calls) == []


CLIENT = """
import asyncio, json, sys
from openai import AsyncOpenAI
from renderers import create_renderer
from renderers.base import load_tokenizer
from renderers.client import generate
from renderers.configs import DefaultRendererConfig

async def main():
    base_url, tokenizer_dir, model = sys.argv[1:4]
    renderer = create_renderer(load_tokenizer(tokenizer_dir), DefaultRendererConfig())
    client = AsyncOpenAI(base_url=base_url, api_key="x")
    out = await generate(client=client, renderer=renderer, messages=[{"role": "user", "content": "say hi"}],
                         model=model, sampling_params={"max_tokens": 8, "seed": 1},
                         extra_headers={"X-Session-ID": "vf-rollout-1"})
    await client.close()
    keep = ("prompt_ids", "completion_ids", "completion_logprobs", "content", "finish_reason")
    print(json.dumps({k: out[k] for k in keep}))

asyncio.run(main())
"""


async def test_the_renderers_client_verifiers_trains_with_reads_the_route(served: dict[str, Any]) -> None:
    """`renderers.client.generate`, the call verifiers' training client makes, run as shipped in
    verifiers' own venv (.venv-vf: it pins openai < 3), against this endpoint's route."""
    import asyncio
    import json
    from pathlib import Path

    from slipstream.envs.verifiers.env import BYTE_TEMPLATE, byte_renderer_dir

    python = Path(__file__).resolve().parents[2] / ".venv-vf" / "bin" / "python"
    if not python.exists():
        pytest.skip(f"verifiers' venv {python} is not built (make verifiers-venv; CI skips: libs/envs README)")
    proc = await asyncio.create_subprocess_exec(
        str(python),
        "-c",
        CLIENT,
        served["ep"].base_url,
        byte_renderer_dir(BYTE_TEMPLATE),
        MODEL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 120)
    assert proc.returncode == 0, err.decode()[-2000:]
    result = json.loads(out.decode().strip().splitlines()[-1])
    (record,) = served["ep"].recorder.calls
    assert record.session_id == "vf-rollout-1"
    assert result["prompt_ids"] == record.prompt_ids == [TOK.bos_id, *TOK.encode("user: say hi\nassistant: ")]
    assert result["completion_ids"] == record.completion_ids
    assert result["completion_logprobs"] == pytest.approx(record.logprobs, abs=1e-6)
    assert result["content"].strip() == TOK.decode([t for t in record.completion_ids if t != TOK.eos_id]).strip()


async def test_n_gt_1_returns_the_group_in_one_call_one_session_per_rollout(served: dict[str, Any]) -> None:
    """No header names the members: the route gives each rollout its own session, so each is an episode."""
    ep, engine, sink = served["ep"], served["engine"], served["sink"]
    prompt = [TOK.bos_id, *TOK.encode("count: 1 2 3")]
    body = {"model": MODEL, "token_ids": prompt, "sampling_params": {"n": 4, "max_tokens": 6, "seed": 11}}
    status, out, headers = await _generate(served, body, None)
    assert status == 200, out
    assert [c["index"] for c in out["choices"]] == [0, 1, 2, 3]
    sessions = out["slipstream"]["session_ids"]
    assert len(set(sessions)) == 4 and headers["x-slipstream-group"]
    for choice, call_id in zip(out["choices"], out["slipstream"]["call_ids"], strict=True):
        (call,) = [c for c in engine.calls if c.request_id == call_id]
        assert list(call.prompt_ids) == prompt
        assert choice["token_ids"] == list(call.completion_ids)
        assert [e["logprob"] for e in choice["logprobs"]["content"]] == list(call.logprobs)
    # Seeds seed + i: the members are different draws, not one sample four times.
    assert len({tuple(c["token_ids"]) for c in out["choices"]}) > 1
    await ep.recorder.flush_all()
    assert sorted(e.metadata["session_id"] for e in sink.episodes) == sorted(sessions)
    assert all(len(e.samples) == 1 and e.samples[0].prompt_len == len(prompt) for e in sink.episodes)


async def test_successive_n_calls_from_one_key_are_separate_rollouts(served: dict[str, Any]) -> None:
    prompt = [TOK.bos_id, *TOK.encode("abc")]
    body = {"model": MODEL, "token_ids": prompt, "sampling_params": {"n": 2, "max_tokens": 3}}
    seen: list[str] = []
    for _ in range(2):
        async with served["http"].post(
            f"{_root(served['ep'])}/inference/v1/generate", json=body, headers={"Authorization": "Bearer sk-one-client"}
        ) as resp:
            assert resp.status == 200
            seen += (await resp.json())["slipstream"]["session_ids"]
    assert len(set(seen)) == 4, seen
    await served["ep"].recorder.flush_all()
    assert len(served["sink"].episodes) == 4


async def test_two_interleaved_n2_calls_are_released_as_one_group_per_prompt(
    model: CausalLM, nats_server: Any, redis_server: Any, tmp_path: Path
) -> None:
    """Two prompts, n=2 each, sent at once and rated interleaved (A0, B0, A1, B1): with
    `group_size` 2 arrival order would pair A0+B0; the release stage publishes {A0, A1} and
    {B0, B1} on traj.raw.serve, and so with two separate calls a client tags with one key."""
    from slipstream.bus import BusConfig, connect_bus
    from slipstream.schemas import Episode
    from slipstream.serve import RedisPending, StoreSink, pending_policy
    from slipstream.store import LocalObjectStore
    from slipstream.store.episodes import load

    engine = TorchEngine(model, TOK, max_batch=8, max_seq_len=1024, device="cpu")
    await engine.start()
    store = LocalObjectStore(tmp_path / "store")
    bus = await connect_bus(BusConfig(url=nats_server.url, stream_storage="memory", fetch_timeout_s=0.2), name="t")
    await bus.ensure_streams()
    raw_in = await bus.consumer("reward-model", Episode)
    cfg = ServeConfig(enabled=True, port=0, renderer="tags", default_max_tokens=4, session_idle_s=3600, group_size=2)
    pending = RedisPending.connect(pending_policy(cfg, "grp"), redis_server.url)
    ep = ServeEndpoint(
        engine,
        TOK,
        cfg,
        StoreSink(store, "grp"),
        model_name=MODEL,
        run_id="grp",
        pending=pending,
        store=store,
        bus=bus,
        release_every_s=3600.0,
    )
    await ep.start()
    root = _root(ep)
    try:
        async with ClientSession() as http:

            async def generate(text: str, headers: dict[str, str], n: int) -> tuple[dict[str, Any], Any]:
                body = {"model": MODEL, "token_ids": [TOK.bos_id, *TOK.encode(text)], "sampling_params": {"n": n}}
                async with http.post(f"{root}/inference/v1/generate", json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json(), resp.headers

            (a, a_headers), (b, b_headers) = await asyncio.gather(
                generate("prompt A", {}, 2), generate("prompt B", {}, 2)
            )
            # Prompt C as two separate calls (two sessions) that the client tags with one key.
            tag = {"x-slipstream-group": "client-c", "x-slipstream-group-size": "2"}
            c0, c0_headers = await generate("prompt C", {**tag, "X-Session-ID": "c-0"}, 1)
            c1, _ = await generate("prompt C", {**tag, "X-Session-ID": "c-1"}, 1)
            assert c0_headers["x-slipstream-group"] == "client-c"
            calls = {
                "A": a["slipstream"]["call_ids"],
                "B": b["slipstream"]["call_ids"],
                "C": [c0["slipstream"]["call_ids"][0], c1["slipstream"]["call_ids"][0]],
            }
            await ep.recorder.flush_all()  # every rollout is an episode, pending its feedback
            for prompt, i in [("A", 0), ("B", 0), ("C", 0), ("A", 1), ("B", 1), ("C", 1)]:
                rate = {"completion_id": calls[prompt][i], "key": "accepted", "value": 1}
                async with http.post(f"{root}/v1/feedback", json=rate) as resp:
                    assert resp.status == 200, await resp.text()
        assert ep.releaser is not None
        assert await ep.releaser.step() == 6
        got: list[Episode] = []
        while len(got) < 6 and (batch := await raw_in.fetch(10, timeout=2.0)):
            got += [d.msg for d in batch]
        groups: dict[str, list[Episode]] = {}
        for stub in got:
            groups.setdefault(stub.group_id, []).append(load(store, stub))
        by_prompt = {frozenset(e.metadata["calls"] for e in members): members for members in groups.values()}
        assert set(by_prompt) == {frozenset(ids) for ids in calls.values()}  # one group per prompt
        keys = {a_headers["x-slipstream-group"], b_headers["x-slipstream-group"], "client-c"}
        assert {members[0].metadata["group_key"] for members in groups.values()} == keys
        for members in groups.values():
            assert sorted(e.group_index for e in members) == [0, 1] and {e.group_size for e in members} == {2}
            assert len({tuple(e.samples[0].ids()[: e.samples[0].prompt_len]) for e in members}) == 1
        assert (await pending.counts())["groups_by_key"] == 3
    finally:
        await ep.close()
        await bus.close()
        await engine.stop()
