"""slipstream.serve without sockets: episode assembly by id prefix, the retry ledger, request validation."""

from __future__ import annotations

import asyncio

import pytest

from slipstream.engine.interface import SamplingParams
from slipstream.serve import CallRecord, MemorySink, Recorder, RequestError, assemble
from slipstream.serve.protocol import body_hash, parse_chat, parse_completion

pytestmark = pytest.mark.unit

LIMITS = {"default_max_tokens": 16, "max_tokens_limit": 64}


def _call(
    n: int, prompt: list[int], completion: list[int], segments: list[tuple[int, int]] | None = None
) -> CallRecord:
    return CallRecord(
        call_id=f"c{n}",
        session_id="s",
        endpoint="chat",
        model="m",
        created=100.0 + n,
        finished_at=100.5 + n,
        prompt_ids=prompt,
        completion_ids=completion,
        logprobs=[-0.1 * (i + 1) for i in range(len(completion))],
        segments=segments or [(0, len(completion))],
        finish_reason="stop",
        params=SamplingParams(max_tokens=8),
        template_hash="h",
        text=f"t{n}",
    )


def test_a_call_that_extends_the_context_extends_the_sample() -> None:
    c1 = _call(1, [1, 2, 3], [4, 5], [(0, 1), (1, 1)])
    c2 = _call(2, [1, 2, 3, 4, 5, 6, 7], [8])  # 6, 7: the user's next turn
    ep = assemble("serve/s/0", [c1, c2], env="serve")
    (s,) = ep.samples
    assert s.ids() == [1, 2, 3, 4, 5, 6, 7, 8] and s.prompt_len == 3
    assert s.mask() == [1, 1, 0, 0, 1]
    assert s.behaviour_logprobs() == pytest.approx([-0.1, -0.2, 0.0, 0.0, -0.1])
    # Observation tokens carry the version in force before them (1), then c2's own version.
    assert [(g.policy_version, g.n_tokens) for g in s.segments] == [(0, 1), (1, 3), (0, 1)]
    assert [(t.role, t.start, t.end) for t in s.turns] == [("policy", 3, 5), ("observation", 5, 7), ("policy", 7, 8)]
    assert ep.final_text == "t2" and ep.counts == {"turns": 2, "samples": 1, "calls": 2}
    assert ep.metadata["calls"] == "c1,c2" and ep.timings.started_at == 101.0


def test_a_prompt_that_is_not_an_extension_starts_a_branch() -> None:
    c1 = _call(1, [1, 2, 3], [4, 5])
    c2 = _call(2, [1, 2, 9, 9], [7])  # history edited after token 2
    ep = assemble("e", [c1, c2], env="serve")
    root, branch = ep.samples
    assert root.ids() == [1, 2, 3, 4, 5] and root.sample_id == "e"
    assert branch.sample_id == "e/s1" and branch.branch_of == "e" and branch.branch_pos == 2
    assert branch.ids() == [1, 2, 9, 9, 7] and branch.prompt_len == 4 and branch.mask() == [1]


def test_assemble_refuses_an_empty_session() -> None:
    with pytest.raises(ValueError, match="no calls"):
        assemble("e", [], env="serve")


async def test_the_ledger_replays_retries_and_forgets_failures() -> None:
    rec = Recorder(MemorySink(), session_idle_s=10, clock=lambda: 0.0)
    assert rec.begin("s", "k") is None  # first: the caller serves it
    waiting = rec.begin("s", "k")  # a retry while it is served waits for it
    assert waiting is not None and not waiting.done()
    call = _call(1, [1], [2])
    await rec.record(call)
    rec.finish("s", "k", call)
    assert await waiting is call
    assert await rec.begin("s", "k") is call  # type: ignore[misc]  # served: replayed
    assert rec.begin("other", "k") is None  # keys are per session
    assert rec.begin("s", "k", replace=True) is None  # a first attempt never replays
    rec.fail("s", "k", RuntimeError("engine died"))
    assert rec.begin("s", "k") is None  # a failed call is served again by its retry
    assert rec.recorded == 1 and rec.coalesced == 2


async def test_idle_sessions_flush_to_the_sink() -> None:
    now = [0.0]
    sink = MemorySink()
    rec = Recorder(sink, session_idle_s=5, clock=lambda: now[0])
    await rec.record(_call(1, [1], [2]))
    now[0] = 3.0
    await rec.record(_call(2, [7], [8]))
    assert await rec.flush_idle() == 0
    now[0] = 10.0
    assert await rec.flush_idle() == 1 and [e.episode_id for e in sink.episodes] == ["serve/s/0"]
    await rec.record(_call(3, [1], [2]))
    stop = asyncio.Event()
    stop.set()
    await rec.sweep(stop)  # a stopped sweeper flushes everything left
    assert [e.episode_id for e in sink.episodes] == ["serve/s/0", "serve/s/1"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m"}, "messages"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": 65}, "n"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 65}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": True}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["a", ""]}, "stop"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
            "stream_options",
        ),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_chat_requests_are_refused_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(RequestError) as info:
        parse_chat(body, **LIMITS)
    assert info.value.param == param and info.value.status == 400
    assert info.value.body()["error"]["param"] == param


def test_valid_requests_become_sampling_params() -> None:
    call = parse_chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "max_completion_tokens": 9,
            "stop": "\n",
            "seed": 4,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "top_k": 5,
            "n": 2,
        },
        **LIMITS,
    )
    assert call.params == SamplingParams(temperature=0.0, top_k=5, max_tokens=9, stop=["\n"], seed=4)
    assert call.stream and call.include_usage and call.n == 2
    assert parse_completion({"model": "m", "prompt": [1, 2]}, **LIMITS).prompt_ids == [1, 2]
    with pytest.raises(RequestError) as info:
        parse_completion({"model": "m", "prompt": [1, True]}, **LIMITS)
    assert info.value.param == "prompt"


def test_body_hash_ignores_key_order_and_spacing() -> None:
    assert body_hash(b'{"a": 1, "b": [2]}') == body_hash(b'{"b":[2],"a":1}') != body_hash(b'{"a": 2, "b": [2]}')
