"""Contract suite for the inference engine: one set of tests, run against every Engine.

`torch` is the in-process TorchEngine; `http` is HttpEngine driving Slipstream's own inference
server (a TorchEngine behind `InferenceServer`) on a free loopback port. Both serve the tiny
byte-level preset built from a fixed seed, so every expectation is computed from an identical
reference model in the test: greedy tokens, the log-probs of sampled ones, and after an
in-flight update the new weights' tokens. Only the Engine protocol is used on the engine under
test (plus `stats()` counters both report). The engines recompute running rows' caches on an
update, which makes "tokens after the update come from the new weights" exact.

TorchEngine's own scheduling details (padded prefill, prefix sharing, eviction order) stay in
tests/unit/test_engine_*.py; HttpEngine's transport failures follow the shared tests here.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import torch

from slipstream.engine import (
    ByteTokenizer,
    CausalLM,
    Engine,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TorchEngine,
    build_tiny,
    process_logits,
)
from slipstream.serve.config import InferenceSection
from slipstream.serve.http_engine import HttpEngine
from slipstream.serve.inference_server import InferenceServer

pytestmark = pytest.mark.contract

ENGINES = ["torch", "http"]
OLD_SEED, NEW_SEED = 21, 22
TOK = ByteTokenizer()
MAX_SEQ = 1100
LONG = 1000  # tokens of a request that must still be running when something happens to it


@dataclass
class Subject:
    engine: Engine
    kind: str
    server: InferenceServer | None = None


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread: OpenMP spinning across two threads on shared cores is far slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int = OLD_SEED) -> CausalLM:
    return build_tiny("tiny", seed=seed)[0].eval()


def _torch_engine() -> TorchEngine:
    return TorchEngine(_model(), TOK, device="cpu", max_batch=8, max_seq_len=MAX_SEQ, recompute_kv_on_update=True)


@pytest.fixture(params=ENGINES)
async def subject(request: pytest.FixtureRequest) -> AsyncIterator[Subject]:
    if request.param == "torch":
        engine = _torch_engine()
        await engine.start()
        yield Subject(engine, "torch")
        await engine.stop()
        return
    server = InferenceServer(_torch_engine(), InferenceSection(host="127.0.0.1", port=0))
    await server.start()
    client = HttpEngine(server.url, connect_timeout_s=5.0, request_timeout_s=60.0, weights_timeout_s=60.0)
    await client.start()
    try:
        yield Subject(client, "http", server)
    finally:
        await client.stop()
        await server.close()


def _req(rid: str, prompt: str | list[int], session: str = "", **params: object) -> GenerationRequest:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    return GenerationRequest(request_id=rid, prompt_ids=ids, params=SamplingParams(**params), session_id=session)  # type: ignore[arg-type]


def _greedy_ref(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def _processed_logprobs(model: CausalLM, res: GenerationResult, temperature: float, top_k: int) -> torch.Tensor:
    full = torch.tensor([res.prompt_ids + res.completion_ids])
    with torch.no_grad():
        logits = model(full)[0, len(res.prompt_ids) - 1 : -1]
    n = len(res.completion_ids)
    lp = process_logits(logits, torch.full((n,), temperature), torch.full((n,), top_k), torch.ones(n))
    return lp.gather(1, torch.tensor(res.completion_ids)[:, None])[:, 0]


async def _wait_version(engine: Engine, version: int, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.policy_version != version:
        assert asyncio.get_running_loop().time() < deadline, (
            f"policy_version stayed {engine.policy_version}: "
            f"{engine.stats()} {getattr(engine, 'last_update_error', '')}"
        )
        await asyncio.sleep(0.005)


async def _running_long(engine: Engine, rid: str) -> asyncio.Task[GenerationResult]:
    """A long greedy request, known to be decoding: a short one batched beside it has finished."""
    long = asyncio.create_task(
        engine.generate(_req(rid, "tell me a long story: ", temperature=0.0, max_tokens=LONG, ignore_eos=True))
    )
    await asyncio.sleep(0)
    await engine.generate(_req(rid + "-probe", "hi", temperature=0.0, max_tokens=3, ignore_eos=True))
    assert not long.done(), "the long request finished before the probe: nothing was in flight"
    return long


# ------------------------------------------------------------------------------ shared contract
async def test_greedy_is_deterministic_and_matches_the_model(subject: Subject) -> None:
    ref = _model()
    prompt = "1+1="
    a = await subject.engine.generate(_req("a", prompt, temperature=0.0, max_tokens=12, ignore_eos=True))
    b = await subject.engine.generate(_req("b", prompt, temperature=0.0, max_tokens=12, ignore_eos=True))
    assert a.completion_ids == b.completion_ids == _greedy_ref(ref, TOK.encode(prompt), 12)
    assert a.prompt_ids == TOK.encode(prompt)
    assert (a.finish_reason, a.segments, len(a.logprobs)) == ("length", [(0, 12)], 12)
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


async def test_seeded_sampling_repeats_and_its_logprobs_are_the_models(subject: Subject) -> None:
    ref = _model()
    params = {"temperature": 0.7, "top_k": 5, "max_tokens": 16, "ignore_eos": True}
    a = await subject.engine.generate(_req("a", "a longer prompt: ", seed=7, **params))
    b = await subject.engine.generate(_req("b", "a longer prompt: ", seed=7, **params))
    c = await subject.engine.generate(_req("c", "a longer prompt: ", seed=8, **params))
    assert a.completion_ids == b.completion_ids
    assert a.completion_ids != c.completion_ids, "seeds 7 and 8 sampled the same 16 tokens"
    assert len(a.logprobs) == len(a.completion_ids) == 16
    want = _processed_logprobs(ref, a, 0.7, 5)
    assert torch.allclose(torch.tensor(a.logprobs), want, atol=1e-4), (a.logprobs, want.tolist())


async def test_stop_strings_stop_ids_and_max_tokens_set_the_finish_reason(subject: Subject) -> None:
    # A random tiny model's greedy output repeats one byte, so sample (seeded).
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 40}
    base = await subject.engine.generate(_req("g", "hello", ignore_eos=True, **params))
    ids = base.completion_ids
    assert (base.finish_reason, len(ids)) == ("length", 40)
    text = TOK.decode(ids)
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].isascii())
    expect = next(n for n in range(1, len(ids) + 1) if stop in TOK.decode(ids[:n]))
    res = await subject.engine.generate(_req("s", "hello", stop=[stop], ignore_eos=True, **params))
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[:expect])
    res = await subject.engine.generate(_req("t", "hello", stop_token_ids=[ids[5]], ignore_eos=True, **params))
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[: ids.index(ids[5]) + 1])
    assert len(res.logprobs) == len(res.completion_ids) and res.segments == [(0, len(res.completion_ids))]


async def test_concurrent_requests_match_solo_runs(subject: Subject) -> None:
    prompts = ["1+1=", "x", "twelve chars", "9*9=", "a longer prompt with more bytes: "]
    reqs = [
        _req(f"r{i}", p, temperature=1.0, top_p=0.95, max_tokens=4 + 3 * i, seed=100 + i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    together = await asyncio.gather(*(subject.engine.generate(r) for r in reqs))
    for r, got in zip(reqs, together, strict=True):
        alone = await subject.engine.generate(_req(r.request_id + "-solo", r.prompt_ids, **msgspec_params(r)))
        assert got.request_id == r.request_id
        assert got.completion_ids == alone.completion_ids, r.request_id
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def msgspec_params(r: GenerationRequest) -> dict[str, object]:
    p = r.params
    return {
        "temperature": p.temperature,
        "top_p": p.top_p,
        "max_tokens": p.max_tokens,
        "seed": p.seed,
        "ignore_eos": True,
    }


async def test_a_session_keeps_its_cache_and_release_drops_it(subject: Subject) -> None:
    e = subject.engine
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    t1 = await e.generate(_req("t1", "turn one: ", session="s", **params))
    prompt2 = t1.prompt_ids + t1.completion_ids + TOK.encode(" <result>42</result> ")
    hits = e.stats()["kv_session_hits"]
    t2 = await e.generate(_req("t2", prompt2, session="s", **params))
    assert e.stats()["kv_session_hits"] == hits + 1
    fresh = await e.generate(_req("t2-fresh", prompt2, **params))  # the whole context prefilled
    assert t2.completion_ids == fresh.completion_ids
    assert t2.logprobs == pytest.approx(fresh.logprobs, abs=1e-4)
    e.release("s")
    prompt3 = prompt2 + t2.completion_ids + TOK.encode(" ok ")
    await e.generate(_req("t3", prompt3, session="s", **params))
    assert e.stats()["kv_session_hits"] == hits + 1, "a released session's cache was reused"


async def test_an_update_in_flight_splits_a_request_between_versions(subject: Subject) -> None:
    e = subject.engine
    new = _model(NEW_SEED)
    long = await _running_long(e, "long")
    e.apply_weights(1, dict(new.state_dict()))
    res = await long
    await _wait_version(e, 1)
    assert len(res.segments) == 2, f"segments {res.segments}: the update did not land mid-request"
    (v0, k), (v1, rest) = res.segments
    assert (v0, v1) == (0, 1) and k > 0 and rest > 0 and k + rest == len(res.completion_ids) == LONG
    assert res.policy_versions == [0] * k + [1] * rest
    ref_old = _model()
    head = _greedy_ref(ref_old, res.prompt_ids, k)
    assert res.completion_ids[:k] == head
    # After the switch: the new weights' greedy tokens given the prefix so far (first 16 checked).
    n = min(16, rest)
    assert res.completion_ids[k : k + n] == _greedy_ref(new, res.prompt_ids + head, n)
    after = await e.generate(_req("after", "1+1=", temperature=0.0, max_tokens=8, ignore_eos=True))
    assert after.segments == [(1, 8)]
    assert after.completion_ids == _greedy_ref(new, TOK.encode("1+1="), 8)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda t: t.update({"model.nonsense.weight": torch.zeros(2)}), "model.nonsense.weight"),
        (lambda t: t.update({"model.norm.weight": torch.zeros(3)}), "model.norm.weight"),
        (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].double()}), "model.norm.weight"),
    ],
    ids=["unknown-name", "wrong-shape", "wrong-dtype"],
)
async def test_a_bad_update_raises_naming_the_tensor_and_changes_nothing(
    subject: Subject, mutate: object, message: str
) -> None:
    e = subject.engine
    tensors = dict(_model(NEW_SEED).state_dict())
    mutate(tensors)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        e.apply_weights(1, tensors)
    await asyncio.sleep(0.05)  # an update wrongly queued would land by now
    res = await e.generate(_req("after", "1+1=", temperature=0.0, max_tokens=8, ignore_eos=True))
    assert e.policy_version == 0 and res.segments == [(0, 8)]
    assert res.completion_ids == _greedy_ref(_model(), TOK.encode("1+1="), 8)


async def test_stop_aborts_what_is_in_flight(subject: Subject) -> None:
    e = subject.engine
    long = await _running_long(e, "long")
    await e.stop()
    res = await asyncio.wait_for(long, 30)
    assert res.finish_reason == "abort"
    assert 0 < len(res.completion_ids) < LONG and len(res.logprobs) == len(res.completion_ids)
    with pytest.raises(RuntimeError, match="not running"):
        await e.generate(_req("late", "x", max_tokens=2))


# ------------------------------------------------------------------------------ HttpEngine only
def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_http_an_unreachable_server_is_named() -> None:
    url = f"http://127.0.0.1:{_closed_port()}"
    engine = HttpEngine(url, connect_timeout_s=2.0)
    with pytest.raises(EngineError, match=f"{url}.*unreachable"):
        await engine.start()


@pytest.fixture
async def served() -> AsyncIterator[InferenceServer]:
    server = InferenceServer(_torch_engine(), InferenceSection(host="127.0.0.1", port=0))
    await server.start()
    yield server
    await server.close()


async def test_http_a_request_past_its_timeout_fails_and_is_aborted(served: InferenceServer) -> None:
    engine = HttpEngine(served.url, request_timeout_s=0.2)
    await engine.start()
    try:
        with pytest.raises(EngineError, match=r"no answer within 0\.2s"):
            await engine.generate(_req("slow", "x", temperature=0.0, max_tokens=LONG, ignore_eos=True))
        for _ in range(2000):  # the abort goes out in the background
            if served.engine.stats()["requests_aborted"] == 1:
                break
            await asyncio.sleep(0.01)
        assert served.engine.stats()["requests_aborted"] == 1
    finally:
        await engine.stop()


async def test_http_a_restarted_server_fails_every_later_call(served: InferenceServer) -> None:
    engine = HttpEngine(served.url, connect_timeout_s=2.0)
    await engine.start()
    port = served.port
    try:
        engine.apply_weights(1, dict(_model(NEW_SEED).state_dict()))
        await _wait_version(engine, 1)
        await served.close()
        again = InferenceServer(_torch_engine(), InferenceSection(host="127.0.0.1", port=port))
        await again.start()
        try:
            errors = []
            for i in range(2):  # the first call may still meet the old server's closed connection
                with pytest.raises(EngineError) as info:
                    await engine.generate(_req(f"r{i}", "x", temperature=0.0, max_tokens=2))
                errors.append(str(info.value))
            assert "restarted" in errors[-1] and "had version 1" in errors[-1], errors
        finally:
            await again.close()
    finally:
        await engine.stop()


async def test_http_a_lora_server_takes_adapter_only_versions() -> None:
    from slipstream.engine.lora import adapter_state, attach_lora

    model = _model()
    attach_lora(model, rank=2, alpha=4.0, targets=["q_proj"], seed=0)
    engine = TorchEngine(model, TOK, device="cpu", max_seq_len=64, allow_partial_updates=True)
    server = InferenceServer(engine, InferenceSection(host="127.0.0.1", port=0))
    await server.start()
    client = HttpEngine(server.url)
    await client.start()
    try:
        adapters = {k: v.detach() + 0.05 for k, v in adapter_state(model).items()}
        assert adapters and all(k.endswith((".lora_A", ".lora_B")) for k in adapters)
        client.apply_weights(1, adapters)  # a subset: accepted because the server allows partial updates
        await _wait_version(client, 1)
        for name, value in adapters.items():
            assert torch.equal(dict(model.named_parameters())[name], value), name
    finally:
        await client.stop()
        await server.close()


async def test_http_weights_are_described_and_downloadable_off_the_loop(served: InferenceServer) -> None:
    engine = HttpEngine(served.url)
    await engine.start()
    try:
        model = _model()
        specs = engine.param_specs()
        assert specs == {n: (tuple(p.shape), "float32") for n, p in model.named_parameters()}
        with pytest.raises(RuntimeError, match=r"asyncio\.to_thread"):
            engine.state_dict()
        got = await asyncio.to_thread(engine.state_dict)
        for name, value in model.state_dict().items():
            assert torch.equal(got[name], value), name
        with pytest.raises(ValueError, match="tensors missing"):  # this server takes full versions only
            engine.apply_weights(1, {"model.norm.weight": got["model.norm.weight"]})
        with pytest.raises(ValueError, match="already in flight"):
            await asyncio.gather(
                *(engine.generate(_req("dup", "x", temperature=0.0, max_tokens=50, ignore_eos=True)) for _ in range(2))
            )
    finally:
        await engine.stop()
