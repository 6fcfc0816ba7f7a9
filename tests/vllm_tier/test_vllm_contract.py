"""tests/contract/test_engine.py's contract on `VllmEngine` over a real vLLM server.

The contract's own test functions are imported from it and run here, against `subject` below (that
suite's fixture, module-scoped: starting a server takes ~30 s to several minutes here) serving the
tiny byte-level preset saved as a Llama checkpoint; expectations come from the same reference model.
They run in this file's order on the one engine: those that need version 0 first, then the updates,
then the contract's `stop` test. Two are replaced where vLLM's semantics differ (libs/engine README,
"vLLM as an engine"), and say so:

- Sessions: vLLM keeps none (no `kv_session_hits`); its prefix cache serves a later turn's prefix,
  counted in its /metrics, and the later turn's tokens equal a fresh request's
  (replaces `test_a_session_keeps_its_cache_and_release_drops_it`).
- Updates wait for requests in flight (vllm_engine.py says why): "an update in flight splits a
  request between versions" becomes "a request in flight finishes wholly on the old version, one
  sent meanwhile waits and runs wholly on the new one"
  (replaces `test_an_update_in_flight_splits_a_request_between_versions`).

The rest here is vLLM's own: a partial update is refused, batch 1/16 figures, versions in a row.
"""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncIterator, Iterator

import contract.test_engine as contract
import pytest
import pytest_asyncio
import torch
from conftest import THREADS, VLLM_PYTHON
from contract.test_engine import LONG, MAX_SEQ, NEW_SEED, OLD_SEED, TOK, Subject, _greedy_ref, _model, _req

from slipstream.engine import save_pretrained
from slipstream.engine.vllm_engine import VllmEngine
from slipstream.engine.vllm_setup import group_rss_mb

pytestmark = [pytest.mark.vllm, pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(2400)]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the reference model: OpenMP spinning on shared cores is far slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def subject(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Subject]:
    """The contract's `subject`: one VllmEngine for the whole module; its process group is gone after."""
    directory = save_pretrained(_model(), TOK, tmp_path_factory.mktemp("tiny") / "model")
    e = VllmEngine(
        directory,
        python=VLLM_PYTHON,
        max_model_len=MAX_SEQ,
        request_timeout_s=300.0,
        threads=THREADS,
        start_timeout_s=1800.0,
    )
    await e.start()
    assert e.proc is not None
    pid = e.proc.pid
    print(f"\nvLLM (tiny) ready in {e.stats()['start_s']:.1f} s, load {os.getloadavg()[0]:.1f}")
    try:
        yield Subject(e, "vllm")
    finally:
        await e.stop()
        assert e.proc is None
        with pytest.raises(ProcessLookupError):  # the whole group is gone: API server, engine core, worker
            os.killpg(pid, 0)


@pytest.fixture(scope="module")
def engine(subject: Subject) -> VllmEngine:
    """The same engine, typed, for the tests below that use VllmEngine's own API."""
    assert isinstance(subject.engine, VllmEngine)
    return subject.engine


async def _wait_version(engine: VllmEngine, version: int, timeout_s: float = 120.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while engine.policy_version != version:
        assert asyncio.get_running_loop().time() < deadline, f"{engine.stats()} {engine.last_update_error}"
        await asyncio.sleep(0.01)


async def _running_long(engine: VllmEngine, rid: str) -> asyncio.Task:
    """A long greedy request, known to be in flight (sent to vLLM, not finished) when this returns."""
    long = asyncio.create_task(
        engine.generate(_req(rid, "tell me a long story: ", temperature=0.0, max_tokens=LONG, ignore_eos=True))
    )
    while engine.stats()["vllm_in_flight"] < 1:
        await asyncio.sleep(0.005)
    await asyncio.sleep(0.1)
    assert not long.done(), "the long request finished at once: nothing was in flight"
    return long


# ------------------------------------------------------------------------------ version 0: the contract's
test_greedy_is_deterministic_and_matches_the_model = contract.test_greedy_is_deterministic_and_matches_the_model
test_seeded_sampling_repeats_and_its_logprobs_are_the_models = (
    contract.test_seeded_sampling_repeats_and_its_logprobs_are_the_models
)
test_stop_strings_stop_ids_and_max_tokens_set_the_finish_reason = (
    contract.test_stop_strings_stop_ids_and_max_tokens_set_the_finish_reason
)
test_concurrent_requests_match_solo_runs = contract.test_concurrent_requests_match_solo_runs
test_a_bad_update_raises_naming_the_tensor_and_changes_nothing = (
    contract.test_a_bad_update_raises_naming_the_tensor_and_changes_nothing
)


# ------------------------------------------------------------------------------ version 0: adapted and vLLM's own
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


async def test_a_partial_update_is_refused_unless_allowed(engine: VllmEngine) -> None:
    with pytest.raises(ValueError, match="tensors missing"):
        engine.apply_weights(1, {"model.norm.weight": _model(NEW_SEED).state_dict()["model.norm.weight"]})


async def test_batches_of_1_and_16_complete_and_are_timed(engine: VllmEngine) -> None:
    """Figures, printed: tokens/s at batch 1 and 16 (48 sampled tokens a row) and the server's memory."""
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


# ------------------------------------------------------------------------------ last: the contract's stop
test_stop_aborts_what_is_in_flight = contract.test_stop_aborts_what_is_in_flight
