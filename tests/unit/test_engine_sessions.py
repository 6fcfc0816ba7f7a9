"""TorchEngine sessions: a multi-turn episode's KV cache kept between its turns.

Reusing a parked cache must change nothing but the work done: the same greedy tokens and the
same log-probs as re-prefilling the whole context every turn, with only the new tokens prefilled.
"""

from __future__ import annotations

import pytest

from slipstream.engine import ByteTokenizer, CausalLM, GenerationRequest, SamplingParams, TorchEngine, build_tiny

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]

TOK = ByteTokenizer()
OBSERVATIONS = [" <result>42</result> ", " ok, next: ", " <result>7</result> done? "]


@pytest.fixture(scope="module")
def model() -> CausalLM:
    m, _ = build_tiny("tiny", seed=5)
    return m.eval()


def _engine(model: CausalLM, **kw: object) -> TorchEngine:
    kw.setdefault("max_seq_len", 256)
    kw.setdefault("max_batch", 4)
    return TorchEngine(model, TOK, device="cpu", **kw)  # type: ignore[arg-type]


def _req(rid: str, prompt: list[int], params: SamplingParams, session: str = "") -> GenerationRequest:
    return GenerationRequest(request_id=rid, prompt_ids=prompt, params=params, session_id=session)


def _finish(engine: TorchEngine, request: GenerationRequest):  # type: ignore[no-untyped-def]
    engine.submit(request)
    for _ in range(1000):
        for result in engine.step():
            if result.request_id == request.request_id:
                return result
    raise AssertionError(f"request {request.request_id} did not finish")


def _episode(engine: TorchEngine, session: str, turns: int = 4) -> tuple[list[int], list[float]]:
    """Greedy multi-turn episode: each turn's prompt is the last prompt + completion + observation."""
    context = TOK.encode("Q: add the numbers. ")
    sampled: list[int] = []
    logprobs: list[float] = []
    for turn in range(turns):
        params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
        result = _finish(
            engine,
            _req(f"{session}/{turn}", context, params, session),
        )
        sampled += result.completion_ids
        logprobs += result.logprobs
        context = [*context, *result.completion_ids, *TOK.encode(OBSERVATIONS[turn % len(OBSERVATIONS)])]
    return sampled, logprobs


def test_kept_cache_gives_the_same_tokens_and_logprobs_as_full_reprefill(model: CausalLM) -> None:
    kept = _engine(model)
    tokens_kept, lps_kept = _episode(kept, "ep")
    fresh = _engine(model)
    tokens_fresh, lps_fresh = _episode(fresh, "")  # no session: every turn re-prefills everything
    assert tokens_kept == tokens_fresh
    assert lps_kept == pytest.approx(lps_fresh, abs=1e-4)
    stats, base = kept.stats(), fresh.stats()
    assert stats["kv_session_hits"] == 3  # turns 2..4 found turn 1..3's cache
    assert stats["kv_session_fallbacks"] == 0
    # Turn t re-uses everything but the last sampled token of turn t-1 (never forwarded).
    assert stats["kv_reused_tokens"] > 0
    assert stats["prefill_tokens"] + stats["kv_reused_tokens"] == base["prefill_tokens"]


def test_a_prompt_that_is_not_an_extension_reuses_only_the_shared_prefix(model: CausalLM) -> None:
    engine = _engine(model)
    prompt = TOK.encode("the shared part, then turn one")
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    first = _finish(engine, GenerationRequest(request_id="a/0", prompt_ids=prompt, params=params, session_id="a"))
    edited = TOK.encode("the shared part, pruned")  # a context edit: shares only a prefix
    second = _finish(engine, GenerationRequest(request_id="a/1", prompt_ids=edited, params=params, session_id="a"))
    reference = _finish(_engine(model), GenerationRequest(request_id="r", prompt_ids=edited, params=params))
    assert first.finish_reason == "length"
    assert second.completion_ids == reference.completion_ids
    assert second.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    stats = engine.stats()
    assert stats["kv_session_fallbacks"] == 1
    assert stats["kv_session_hits"] == 0
    assert stats["kv_reused_tokens"] == len(TOK.encode("the shared part, "))


def test_parked_sessions_are_evicted_least_recent_first_when_a_slot_is_needed(model: CausalLM) -> None:
    engine = _engine(model, max_batch=2)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    for name in ("s1", "s2"):
        _finish(
            engine,
            _req(f"{name}/0", TOK.encode(name), params, name),
        )
    assert engine.stats()["kv_sessions_parked"] == 2
    _finish(engine, GenerationRequest(request_id="other", prompt_ids=TOK.encode("other"), params=params))
    stats = engine.stats()
    assert stats["kv_session_evictions"] == 1
    assert stats["kv_sessions_parked"] == 1
    # s1 was parked first, so it went; s2's next turn still finds its cache.
    prompt = [
        *TOK.encode("s2"),
        *_finish(engine, _req("probe", TOK.encode("s2"), params)).completion_ids,
    ]
    _finish(engine, GenerationRequest(request_id="s2/1", prompt_ids=prompt, params=params, session_id="s2"))
    assert engine.stats()["kv_session_hits"] == 1


def test_release_frees_the_slot_and_an_aborted_request_parks_nothing(model: CausalLM) -> None:
    engine = _engine(model, max_batch=2)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    _finish(engine, GenerationRequest(request_id="k/0", prompt_ids=TOK.encode("keep"), params=params, session_id="k"))
    assert engine.stats()["kv_sessions_parked"] == 1
    engine.release("k")
    engine.release("never-seen")
    engine.step()
    assert engine.stats()["kv_sessions_parked"] == 0

    long = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.submit(GenerationRequest(request_id="x/0", prompt_ids=TOK.encode("abort me"), params=long, session_id="x"))
    engine.step()
    engine.abort("x/0")
    results = engine.step()
    assert [r.finish_reason for r in results] == ["abort"]
    assert engine.stats()["kv_sessions_parked"] == 0
