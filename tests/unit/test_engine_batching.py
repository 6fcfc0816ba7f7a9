"""TorchEngine generation: KV-cached continuous batching against naive full recomputation,
per-request determinism, stop rules, aborts, request validation and the async face."""

from __future__ import annotations

import asyncio

import pytest
import torch

from slipstream.engine import (
    ByteTokenizer,
    CausalLM,
    EngineError,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    TorchEngine,
    build_tiny,
    process_logits,
)

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

SEED = 3
PROMPTS = ["1+1=", "a longer prompt with more bytes: ", "x", "twelve chars", "9*9="]


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m, _ = build_tiny("tiny", seed=SEED)
    return m.eval()


TOK = ByteTokenizer()


def _engine(model: CausalLM, **kw: object) -> TorchEngine:
    kw.setdefault("max_seq_len", 128)
    return TorchEngine(model, TOK, device="cpu", **kw)  # type: ignore[arg-type]


def _req(rid: str, prompt: str, **params: object) -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=TOK.encode(prompt), params=SamplingParams(**params))  # type: ignore[arg-type]


def _run(engine: TorchEngine, requests: list[GenerationRequest]) -> dict[str, GenerationResult]:
    for r in requests:
        engine.submit(r)
    out: dict[str, GenerationResult] = {}
    for _ in range(10_000):
        if not engine.has_work:
            break
        for res in engine.step():
            out[res.request_id] = res
    return out


def _naive_greedy(model: CausalLM, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt) :]


def test_greedy_with_kv_cache_equals_naive_recompute(model: CausalLM) -> None:
    engine = _engine(model, max_batch=4)
    reqs = [_req(str(i), p, temperature=0.0, max_tokens=20, ignore_eos=True) for i, p in enumerate(PROMPTS[:3])]
    got = _run(engine, reqs)
    for r in reqs:
        res = got[r.request_id]
        assert res.completion_ids == _naive_greedy(model, r.prompt_ids, 20), f"request {r.request_id}"
        assert res.finish_reason == "length"
        assert res.segments == [(0, 20)]
        assert len(res.logprobs) == 20 and all(lp <= 0.0 for lp in res.logprobs)
    assert engine.stats()["tokens_generated"] == 60


def test_sampled_logprobs_match_recomputed_processed_distribution(model: CausalLM) -> None:
    engine = _engine(model, max_batch=2)
    req = _req("s", PROMPTS[1], temperature=0.7, top_k=5, max_tokens=16, seed=SEED, ignore_eos=True)
    res = _run(engine, [req])["s"]
    full = torch.tensor([req.prompt_ids + res.completion_ids])
    with torch.no_grad():
        logits = model(full)[0, len(req.prompt_ids) - 1 : -1]
    n = len(res.completion_ids)
    lp = process_logits(logits, torch.full((n,), 0.7), torch.full((n,), 5), torch.ones(n))
    want = lp.gather(1, torch.tensor(res.completion_ids)[:, None])[:, 0]
    assert torch.allclose(torch.tensor(res.logprobs), want, atol=1e-4), (res.logprobs, want.tolist())


def test_continuous_batching_matches_solo_runs(model: CausalLM) -> None:
    reqs = [
        _req(f"r{i}", p, temperature=1.0, top_p=0.95, max_tokens=4 + 3 * i, seed=100 + i, ignore_eos=True)
        for i, p in enumerate(PROMPTS)
    ]
    engine = _engine(model, max_batch=2)
    for r in reqs:
        engine.submit(r)
    batched: dict[str, GenerationResult] = {}
    peak_running = peak_waiting = 0
    while engine.has_work:
        for res in engine.step():
            batched[res.request_id] = res
        stats = engine.stats()
        peak_running = max(peak_running, int(stats["running"]))
        peak_waiting = max(peak_waiting, int(stats["waiting"]))
    assert sorted(batched) == [r.request_id for r in reqs]
    assert peak_running == 2 and peak_waiting >= 2  # slots really were shared
    for r in reqs:
        solo = _run(_engine(model, max_batch=1), [r])[r.request_id]
        assert batched[r.request_id].completion_ids == solo.completion_ids, r.request_id
        assert len(solo.completion_ids) == r.params.max_tokens


def test_max_tokens_and_max_seq_len_end_with_length(model: CausalLM) -> None:
    res = _run(_engine(model), [_req("a", "abc", temperature=0.0, max_tokens=7, ignore_eos=True)])["a"]
    assert (res.finish_reason, len(res.completion_ids)) == ("length", 7)
    engine = _engine(model, max_seq_len=16)
    res = _run(engine, [_req("b", "0123456789", temperature=0.0, max_tokens=100, ignore_eos=True)])["b"]
    assert res.finish_reason == "length"
    assert len(res.prompt_ids) + len(res.completion_ids) == 16


def test_stop_string_stop_token_and_eos_end_with_stop(model: CausalLM) -> None:
    # A random tiny model's greedy output collapses into one repeated byte, so sample (seeded).
    params = {"temperature": 1.0, "seed": SEED, "max_tokens": 40}
    base = _run(_engine(model), [_req("g", "hello", ignore_eos=True, **params)])["g"]
    ids = base.completion_ids
    assert TOK.eos_id not in ids[:7]
    text = TOK.decode(ids)
    # A stop string taken from the middle of the free-running text.
    stop = next(text[i : i + 2] for i in range(4, len(text) - 2) if text[i : i + 2].isascii())
    expect = next(n for n in range(1, len(ids) + 1) if stop in TOK.decode(ids[:n]))
    assert expect < len(ids)
    res = _run(_engine(model), [_req("s", "hello", stop=[stop], **params)])["s"]
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[:expect])

    res = _run(_engine(model), [_req("t", "hello", stop_token_ids=[ids[5]], **params)])["t"]
    first = ids.index(ids[5])
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[: first + 1])

    class EosIsSix(ByteTokenizer):
        @property
        def eos_id(self) -> int:
            return ids[6]

    engine = TorchEngine(model, EosIsSix(), device="cpu", max_seq_len=128)
    res = _run(engine, [_req("e", "hello", **params)])["e"]
    assert (res.finish_reason, res.completion_ids) == ("stop", ids[: ids.index(ids[6]) + 1])


def test_abort_running_and_waiting_requests(model: CausalLM) -> None:
    engine = _engine(model, max_batch=1)
    engine.submit(_req("run", "abc", temperature=0.0, max_tokens=50, ignore_eos=True))
    engine.submit(_req("wait", "abc", temperature=0.0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        assert engine.step() == []
    assert engine.abort("run") and engine.abort("wait")
    assert not engine.abort("unknown")
    done = {r.request_id: r for r in engine.step()}
    assert done["run"].finish_reason == "abort" and len(done["run"].completion_ids) == 4
    assert done["wait"].finish_reason == "abort" and done["wait"].completion_ids == []
    assert not engine.has_work
    assert engine.stats()["requests_aborted"] == 2


def test_bad_requests_are_refused_with_a_reason(model: CausalLM) -> None:
    engine = _engine(model, max_seq_len=8)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.submit(GenerationRequest(request_id="e", prompt_ids=[]))
    with pytest.raises(ValueError, match=r"token ids \[300\] outside the vocabulary"):
        engine.submit(GenerationRequest(request_id="v", prompt_ids=[1, 300]))
    with pytest.raises(ValueError, match="max_seq_len 8 leaves no room"):
        engine.submit(GenerationRequest(request_id="l", prompt_ids=[1] * 8))
    engine.submit(GenerationRequest(request_id="d", prompt_ids=[1]))
    with pytest.raises(ValueError, match="'d' is already in flight"):
        engine.submit(GenerationRequest(request_id="d", prompt_ids=[2]))


async def test_async_generate_matches_sync_and_stop_aborts(model: CausalLM) -> None:
    reqs = [_req(f"a{i}", p, temperature=0.9, max_tokens=12, seed=i, ignore_eos=True) for i, p in enumerate(PROMPTS)]
    want = _run(_engine(model, max_batch=2), reqs)
    engine = _engine(model, max_batch=2)
    await engine.start()
    got = await asyncio.gather(*(engine.generate(r) for r in reqs))
    assert [g.completion_ids for g in got] == [want[r.request_id].completion_ids for r in reqs]
    assert all(g.timings.finished_at >= g.timings.started_at >= g.timings.queued_at > 0 for g in got)
    long = asyncio.create_task(engine.generate(_req("long", "abc", temperature=0.0, max_tokens=100, ignore_eos=True)))
    while engine.stats()["tokens_generated"] < 5 * 12 + 3:
        await asyncio.sleep(0.001)
    await engine.stop()
    res = await long
    assert res.finish_reason == "abort" and 0 < len(res.completion_ids) < 100
    with pytest.raises(RuntimeError, match="not running"):
        await engine.generate(_req("late", "abc"))


async def test_a_failing_step_fails_waiters_and_later_calls(model: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    engine = _engine(model, max_batch=2)

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("simulated device failure")

    await engine.start()
    monkeypatch.setattr(engine.model, "hidden_cached", broken)
    with pytest.raises(EngineError, match="simulated device failure"):
        await engine.generate(_req("x", "abc", max_tokens=3))
    assert isinstance(engine.error, RuntimeError)
    with pytest.raises(EngineError, match="engine loop failed"):
        await engine.generate(_req("y", "abc", max_tokens=3))
    await engine.stop()


async def test_cancelled_generate_frees_its_slot(model: CausalLM) -> None:
    engine = _engine(model, max_batch=1)
    await engine.start()
    try:
        task = asyncio.create_task(engine.generate(_req("c", "abc", temperature=0.0, max_tokens=100, ignore_eos=True)))
        while engine.stats()["tokens_generated"] < 3:
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The slot is free again: the next request runs to completion on the single slot.
        res = await asyncio.wait_for(engine.generate(_req("n", "abc", temperature=0.0, max_tokens=4)), timeout=10)
        assert res.finish_reason in ("length", "stop") and engine.stats()["requests_aborted"] == 1
    finally:
        await engine.stop()


def _count_forwards(engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Record the [rows, tokens] shape of every forward the engine makes (all go through `hidden_cached`)."""
    shapes: list[tuple[int, int]] = []
    real = engine.model.hidden_cached

    def counted(ids: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        shapes.append((int(ids.shape[0]), int(ids.shape[1])))
        return real(ids, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(engine.model, "hidden_cached", counted)
    return shapes


def test_ragged_prompts_are_prefilled_in_one_padded_forward_and_match_solo_runs(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = ["1+1=", "23+4=", "9*9=", "7-2=", "55+5="]
    reqs = [
        _req(f"p{i}", p, temperature=1.0, max_tokens=6, seed=40 + i, ignore_eos=True) for i, p in enumerate(prompts)
    ]
    engine = _engine(model, max_batch=len(prompts))
    shapes = _count_forwards(engine, monkeypatch)
    batched = _run(engine, reqs)
    # One prefill of 5 rows padded to the longest prompt, then 1-token decodes.
    assert shapes[0] == (5, max(len(r.prompt_ids) for r in reqs)) and all(t == 1 for _, t in shapes[1:])
    assert engine.stats()["prefill_tokens"] == sum(len(r.prompt_ids) for r in reqs)
    for r in reqs:
        solo = _run(_engine(model, max_batch=1), [r])[r.request_id]
        assert batched[r.request_id].completion_ids == solo.completion_ids, r.request_id
        assert batched[r.request_id].logprobs == pytest.approx(solo.logprobs, abs=1e-4)


def test_a_groups_identical_prompts_are_prefilled_once(model: CausalLM, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt = "the same task for every sample: "
    reqs = [_req(f"g{i}", prompt, temperature=1.0, max_tokens=5, seed=10 + i, ignore_eos=True) for i in range(4)]
    reqs.append(_req("other", "another prompt", temperature=1.0, max_tokens=5, seed=9, ignore_eos=True))
    engine = _engine(model, max_batch=5)
    shapes = _count_forwards(engine, monkeypatch)
    batched = _run(engine, reqs)
    n = len(reqs[0].prompt_ids)
    stats = engine.stats()
    assert stats["prefill_tokens"] == n + len(reqs[-1].prompt_ids)
    assert stats["prompt_shared_tokens"] == 3 * n
    assert sum(rows * t for rows, t in shapes if t > 1) <= 2 * n  # the group's prompt went through once
    # Each sample still draws from its own stream, so the group's samples differ from each other
    # and each equals the same request run alone.
    assert len({tuple(batched[f"g{i}"].completion_ids) for i in range(4)}) > 1
    for r in reqs:
        solo = _run(_engine(model, max_batch=1), [r])[r.request_id]
        assert batched[r.request_id].completion_ids == solo.completion_ids, r.request_id
        assert batched[r.request_id].logprobs == pytest.approx(solo.logprobs, abs=1e-4)


def test_a_prompt_admitted_later_copies_a_running_siblings_prefix(model: CausalLM) -> None:
    prompt = "a group whose samples arrive one by one: "
    first, second = (
        _req(f"s{i}", prompt, temperature=1.0, max_tokens=6, seed=70 + i, ignore_eos=True) for i in range(2)
    )
    engine = _engine(model, max_batch=2)
    engine.submit(first)
    out = {r.request_id: r for r in engine.step()}  # first is running, its prompt cached
    engine.submit(second)
    while engine.has_work:
        out.update({r.request_id: r for r in engine.step()})
    n = len(first.prompt_ids)
    stats = engine.stats()
    assert stats["prompt_shared_tokens"] == n - 1  # all but the last token, whose logits are needed
    assert stats["prefill_tokens"] == n + 1
    for r in (first, second):
        solo = _run(_engine(model, max_batch=1), [r])[r.request_id]
        assert out[r.request_id].completion_ids == solo.completion_ids, r.request_id
        assert out[r.request_id].logprobs == pytest.approx(solo.logprobs, abs=1e-4)


def test_distinct_prompts_that_open_alike_prefill_the_common_prefix_once(
    model: CausalLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A system prompt shared by distinct questions (and one prompt sharing nothing): the common
    # prefix goes through one forward, every row still samples exactly what it samples alone.
    system = "You are a careful assistant. Answer briefly.\n"
    questions = ["What is 2+2?", "Name a colour.", "Spell cat backwards, please."]
    reqs = [
        _req(f"q{i}", system + q, temperature=1.0, max_tokens=6, seed=50 + i, ignore_eos=True)
        for i, q in enumerate(questions)
    ]
    reqs.append(_req("alone", "unrelated text", temperature=1.0, max_tokens=6, seed=49, ignore_eos=True))
    engine = _engine(model, max_batch=4)
    shapes = _count_forwards(engine, monkeypatch)
    batched = _run(engine, reqs)
    n = len(TOK.encode(system))  # the byte tokenizer: a token per byte (no bos in _req's ids)
    shared = len(reqs[0].prompt_ids) - len(questions[0])
    assert shared >= n
    stats = engine.stats()
    assert stats["prompt_shared_tokens"] == 2 * shared
    assert stats["prefill_tokens"] == sum(len(r.prompt_ids) for r in reqs) - 2 * shared
    assert (1, shared) in shapes  # the prefix's own forward
    for r in reqs:
        solo = _run(_engine(model, max_batch=1), [r])[r.request_id]
        assert batched[r.request_id].completion_ids == solo.completion_ids, r.request_id
        assert batched[r.request_id].logprobs == pytest.approx(solo.logprobs, abs=1e-4)


def test_a_row_that_would_shrink_the_shared_prefix_stays_out_of_the_cluster() -> None:
    engine = _engine(build_tiny("micro", seed=0)[0].eval(), max_batch=4)
    long = "a long shared opening line. "
    reqs = [_req(f"r{i}", long + tail, max_tokens=1) for i, tail in enumerate(("one", "two", "six"))]
    reqs.append(_req("short", "a long x", max_tokens=1))  # shares only "a long " with the others
    _run(engine, reqs)
    n = len(reqs[0].prompt_ids) - 3
    assert engine.stats()["prompt_shared_tokens"] == 2 * n
