"""Rubric judges against a scripted judge server, through the real `openai` client over loopback.

The server (tests/scripted_judge.py) answers per rubric and per attempt: valid verdicts, malformed
ones, answers slower than the judge's timeout, 429s with Retry-After. What is asserted is what
the judge did with them: the votes across rubrics, re-asks then *unscorable* (never a made-up
score), timeouts and rate limits retried within their budgets, the concurrency and rate limits
seen from the server's side, and verdicts served from a real Redis on the second ask.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from scripted_judge import Call, Reply, ScriptedJudge, score, too_many

from slipstream.control.client import ControlClient
from slipstream.engine.tokenizer import ByteTokenizer
from slipstream.judge import Judge, JudgeConfig, JudgeInput, VerdictCache, sample_rubrics
from slipstream.serve import MemorySink, ServeConfig, ServeEndpoint
from slipstream.stack import Server
from slipstream.supervised.scripted import ScriptedEngine

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

RUBRICS = {
    "direct": ("The answer addresses the request directly, without preamble.", 2.0),
    "correct": ("The answer is factually correct.", 1.0),
    "polite": ("The answer is polite.", 1.0),
    "brief": ("The answer is brief.", 1.0),
    "cites": ("The answer cites its sources.", 1.0),
}
TEXT = {rid: text for rid, (text, _) in RUBRICS.items()}
BY_TEXT = {text: rid for rid, text in TEXT.items()}
# The scores the scripted judge gives, out of 10.
SCORES = {"direct": 9, "correct": 6, "polite": 3, "brief": 10, "cites": 0}


def rubric_file(tmp_path: Path, version: str = "v1") -> Path:
    lines = [f'[[rubric_set]]\ncontext = "serve"\nversion = "{version}"\n']
    for rid, (text, weight) in RUBRICS.items():
        lines.append(f'[[rubric_set.rubrics]]\nid = "{rid}"\ntext = "{text}"\nweight = {weight}\n')
    path = tmp_path / f"rubrics-{version}.toml"
    path.write_text("\n".join(lines))
    return path


def scripted(overrides: dict[str, Callable[[Call], Reply]] | None = None) -> Callable[[Call], Reply]:
    """Each rubric's score from SCORES, except the rubrics `overrides` script."""

    def script(call: Call) -> Reply:
        rid = BY_TEXT[call.rubric]
        if overrides and rid in overrides:
            return overrides[rid](call)
        return score(SCORES[rid])

    return script


@pytest.fixture
async def server() -> AsyncIterator[ScriptedJudge]:
    srv = await ScriptedJudge(scripted()).start()
    yield srv
    await srv.close()


def make_judge(srv: ScriptedJudge, tmp_path: Path, cache: VerdictCache | None = None, **cfg: Any) -> Judge:
    defaults: dict[str, Any] = {"k": 0, "timeout_s": 5.0, "backoff_s": 0.01, "cache": cache is not None}
    config = JudgeConfig(
        url=srv.url,
        model=cfg.pop("model", "judge-7b"),
        envs=["serve"],
        rubric_file=str(cfg.pop("rubric_file", rubric_file(tmp_path))),
        context="serve",
        **{**defaults, **cfg},
    )
    return Judge.from_config("helpful", config, cache=cache, api_key="sk-test")


def item(episode_id: str = "ep-1", response: str = "Paris.") -> JudgeInput:
    return JudgeInput(episode_id=episode_id, response=response, prompt="Capital of France?", reference="Paris")


# -- votes across rubrics ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        # (0.9 * 2 + 0.6 + 0.3 + 1.0 + 0.0) / 6: the weighted mean.
        ("mean", 3.7 / 6),
        # Median of 0.9, 0.6, 0.3, 1.0, 0.0.
        ("median", 0.6),
        # Pass (>= 0.5): direct (2) + correct + brief = 4 of 6 weight: the majority passes.
        ("majority", 1.0),
    ],
)
async def test_all_rubrics_are_asked_and_their_votes_aggregate(
    server: ScriptedJudge, tmp_path: Path, aggregation: str, expected: float
) -> None:
    judge = make_judge(server, tmp_path, aggregation=aggregation)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert j.unscorable == "" and j.failures == {}
    assert j.scores == pytest.approx({rid: s / 10 for rid, s in SCORES.items()})
    assert j.aggregate == pytest.approx(expected)
    assert (j.judge, j.model, j.rubric_set, j.aggregation) == ("helpful", "judge-7b", "serve@v1", aggregation)
    assert sorted(j.rubric_ids) == sorted(RUBRICS)
    assert len(server.calls) == 5 and {c.model for c in server.calls} == {"judge-7b"}
    # The judge was shown the task, the reference and the response.
    user = server.calls[0].messages[-1]["content"]
    assert "Capital of France?" in user and "<reference>\nParis\n</reference>" in user and "Paris." in user


async def test_k_of_m_rubrics_are_sampled_by_episode_id(server: ScriptedJudge, tmp_path: Path) -> None:
    judge = make_judge(server, tmp_path, k=2)
    try:
        first = [await judge.judge(item(f"ep-{i}")) for i in range(12)]
        again = await judge.judge(item("ep-3"))
    finally:
        await judge.close()
    assert all(len(j.rubric_ids) == 2 for j in first)
    assert again.rubric_ids == first[3].rubric_ids  # the same episode meets the same rubrics
    assert len({tuple(sorted(j.rubric_ids)) for j in first}) >= 4  # and episodes meet different ones
    for i, j in enumerate(first):
        assert j.rubric_ids == [r.id for r in sample_rubrics(judge.rubric_set, 2, f"ep-{i}")]
        assert set(j.scores) == set(j.rubric_ids)
        assert j.aggregate == pytest.approx(
            sum(SCORES[r] / 10 * RUBRICS[r][1] for r in j.rubric_ids) / sum(RUBRICS[r][1] for r in j.rubric_ids)
        )
    assert len(server.calls) == 2 * 13  # only the sampled rubrics were asked


# -- malformed verdicts -----------------------------------------------------------------------------


async def test_a_malformed_verdict_is_reasked_with_the_problem_named(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted({"polite": lambda c: Reply(text="Seems fine to me.") if c.attempt == 0 else score(7)})
    judge = make_judge(server, tmp_path, parse_retries=2)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert j.unscorable == "" and j.scores["polite"] == pytest.approx(0.7)
    polite = server.calls_about(TEXT["polite"])
    assert len(polite) == 2 and judge.stats.malformed == 1
    reask = polite[1].messages
    assert [m["role"] for m in reask] == ["system", "user", "assistant", "user"]
    assert reask[2]["content"] == "Seems fine to me."
    assert "SCORE: <n>" in reask[3]["content"] and "Seems fine to me." in reask[3]["content"]


@pytest.mark.parametrize("verdict", ["SCORE: eleven", "SCORE: 11", '{"score": "high"}', "", "SCORE: 5\nThanks!"])
async def test_malformed_forever_is_unscorable_after_the_retry_budget_never_a_zero(
    server: ScriptedJudge, tmp_path: Path, verdict: str
) -> None:
    server.script = scripted({"cites": lambda c: Reply(text=verdict)})
    judge = make_judge(server, tmp_path, parse_retries=2)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert len(server.calls_about(TEXT["cites"])) == 3  # the first ask and two re-asks
    assert "cites" not in j.scores and j.failures == {"cites": "malformed"}
    assert j.unscorable.startswith("judge helpful: 4 of 5 rubrics scored, 5 needed: cites: malformed (3 malformed")
    assert j.aggregate == 0.0
    assert judge.stats.rubric_failures == {"malformed": 1} and judge.stats.unscorable == 1


# -- prefilled verdicts -----------------------------------------------------------------------------

PREFILLED = {"role": "assistant", "content": "SCORE:"}


async def test_a_prefilled_verdict_continues_the_open_assistant_message(server: ScriptedJudge, tmp_path: Path) -> None:
    """With `prefill` the request ends with the open assistant message and vLLM's continuation
    extras; the judge writes only the number, and prefill + number is parsed (strictly: a first
    answer that is not a number is re-asked, the prefill opened again)."""

    def number(call: Call) -> Reply:
        if call.messages[-1] != PREFILLED:
            return Reply(text="prose, no verdict")  # the prefill is missing: never parses
        if BY_TEXT[call.rubric] == "polite" and call.attempt == 0:
            return Reply(text=" seven")
        return Reply(text=f" {SCORES[BY_TEXT[call.rubric]]}")

    server.script = number
    judge = make_judge(server, tmp_path, prefill="SCORE:", max_tokens=4, parse_retries=1)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert j.unscorable == "" and j.scores == pytest.approx({rid: s / 10 for rid, s in SCORES.items()})
    assert len(server.calls) == 6 and judge.stats.malformed == 1
    for call in server.calls:
        assert call.body["continue_final_message"] is True and call.body["add_generation_prompt"] is False
        assert call.body["max_tokens"] == 4 and call.body["stop"] == ["\n"]
    first, reask = server.calls_about(TEXT["polite"])
    assert [m["role"] for m in first.messages] == ["system", "user", "assistant"]
    # The re-ask shows the whole malformed verdict (prefill included), then opens the prefill again.
    assert [m["role"] for m in reask.messages] == ["system", "user", "assistant", "user", "assistant"]
    assert reask.messages[2]["content"] == "SCORE: seven" and reask.messages[-1] == PREFILLED


async def test_without_prefill_no_continuation_extras_are_sent(server: ScriptedJudge, tmp_path: Path) -> None:
    judge = make_judge(server, tmp_path, k=1)
    try:
        await judge.judge(item())
    finally:
        await judge.close()
    (call,) = server.calls
    assert call.messages[-1]["role"] == "user"
    assert not {"continue_final_message", "add_generation_prompt", "stop"} & set(call.body)


async def test_min_scored_lets_the_other_rubrics_carry_the_verdict(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted({"cites": lambda c: Reply(text="no idea")})
    judge = make_judge(server, tmp_path, parse_retries=0, min_scored=4)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert j.unscorable == "" and j.failures == {"cites": "malformed"}
    assert j.aggregate == pytest.approx((0.9 * 2 + 0.6 + 0.3 + 1.0) / 5)  # cites is left out, not counted 0


# -- timeouts, 429s, server errors --------------------------------------------------------------------


async def test_a_slow_judge_times_out_then_is_unscorable(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted({"brief": lambda c: Reply(text="SCORE: 5", delay_s=2.0)})
    judge = make_judge(server, tmp_path, timeout_s=0.3, call_retries=1)
    started = time.monotonic()
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    elapsed = time.monotonic() - started
    assert len(server.calls_about(TEXT["brief"])) == 2 and j.failures == {"brief": "timeout"}
    assert "brief: timeout (no answer within 0.3s" in j.unscorable and "after 2 tries" in j.unscorable
    assert elapsed < 2.5, f"the timeout did not bound the calls: {elapsed:.2f}s"
    assert judge.stats.retries == {"timeout": 1}


async def test_a_slow_first_answer_is_retried_and_scored(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted({"brief": lambda c: Reply(text="SCORE: 4", delay_s=2.0 if c.attempt == 0 else 0.0)})
    judge = make_judge(server, tmp_path, timeout_s=0.3, call_retries=2)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert j.unscorable == "" and j.scores["brief"] == pytest.approx(0.4)
    assert len(server.calls_about(TEXT["brief"])) == 2


async def test_429_retry_after_is_honoured(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted({"correct": lambda c: too_many("1") if c.attempt == 0 else score(8)})
    judge = make_judge(server, tmp_path, call_retries=2, max_backoff_s=5.0)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    first, second = server.calls_about(TEXT["correct"])
    assert second.arrived - first.arrived >= 0.95, "the client came back before Retry-After: 1"
    assert j.unscorable == "" and j.scores["correct"] == pytest.approx(0.8)
    assert judge.stats.retries == {"rate_limited": 1}


async def test_429_forever_is_unscorable_and_retry_after_is_capped(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted({"correct": lambda c: too_many("30")})
    judge = make_judge(server, tmp_path, call_retries=2, max_backoff_s=0.1)
    started = time.monotonic()
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert time.monotonic() - started < 3.0, "Retry-After: 30 was not capped at max_backoff_s"
    assert len(server.calls_about(TEXT["correct"])) == 3
    assert j.failures == {"correct": "rate_limited"} and "correct: rate_limited (HTTP 429" in j.unscorable


async def test_server_errors_are_retried_and_bad_requests_are_not(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = scripted(
        {
            "polite": lambda c: Reply(status=503) if c.attempt == 0 else score(6),
            "cites": lambda c: Reply(status=400),
        }
    )
    judge = make_judge(server, tmp_path, call_retries=3)
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
    assert j.scores["polite"] == pytest.approx(0.6) and len(server.calls_about(TEXT["polite"])) == 2
    assert j.failures == {"cites": "rejected"} and len(server.calls_about(TEXT["cites"])) == 1


# -- limits ------------------------------------------------------------------------------------------


async def test_concurrency_limit_holds_across_episodes(server: ScriptedJudge, tmp_path: Path) -> None:
    server.script = lambda c: Reply(text="SCORE: 5", delay_s=0.15)
    judge = make_judge(server, tmp_path, concurrency=2)
    try:
        results = await asyncio.gather(*(judge.judge(item(f"ep-{i}")) for i in range(3)))
    finally:
        await judge.close()
    assert all(j.unscorable == "" for j in results)
    assert len(server.calls) == 15 and server.max_in_flight == 2


async def test_rate_limit_spaces_call_starts(server: ScriptedJudge, tmp_path: Path) -> None:
    judge = make_judge(server, tmp_path, rate_per_s=20.0, burst=1, concurrency=16)
    try:
        await asyncio.gather(*(judge.judge(item(f"ep-{i}")) for i in range(2)))
    finally:
        await judge.close()
    arrivals = sorted(c.arrived for c in server.calls)
    assert len(arrivals) == 10
    # 10 starts at 20/s with a burst of 1: the last comes at least 9/20 s after the first.
    assert arrivals[-1] - arrivals[0] >= 0.4


# -- the Redis cache ---------------------------------------------------------------------------------


async def test_verdicts_are_cached_in_redis_by_rubric_version_model_and_prompt(
    server: ScriptedJudge, redis_server: Server, tmp_path: Path
) -> None:
    server.script = scripted({"cites": lambda c: Reply(text="unsure")})
    client = ControlClient(redis_server.url)
    cache = VerdictCache(client, ttl_s=600)
    judge = make_judge(server, tmp_path, cache=cache, parse_retries=0, min_scored=4)
    v2 = make_judge(
        server, tmp_path, cache=cache, parse_retries=0, min_scored=4, rubric_file=rubric_file(tmp_path, "v2")
    )
    other_model = make_judge(server, tmp_path, cache=cache, parse_retries=0, min_scored=4, model="judge-70b")
    try:
        first = await judge.judge(item())
        assert (len(server.calls), first.cached, judge.stats.cache_misses) == (5, 0, 5)
        again = await judge.judge(item())
        # Four valid verdicts came from Redis; the malformed one was never cached and was asked again.
        assert (len(server.calls), again.cached, judge.stats.cache_hits) == (6, 4, 4)
        assert again.scores == first.scores and again.aggregate == pytest.approx(first.aggregate)
        await judge.judge(item(response="Lyon."))  # another response: another prompt digest
        assert len(server.calls) == 11
        await v2.judge(item())  # another rubric version
        assert len(server.calls) == 16 and v2.stats.cache_hits == 0
        await other_model.judge(item())  # another judge model
        assert len(server.calls) == 21 and other_model.stats.cache_hits == 0
        keys = sorted(await client.redis.keys("slipstream:judge:*"))
        assert len(keys) == 4 * 4  # (v1, Paris.), (v1, Lyon.), (v2, Paris.), (judge-70b): 4 valid verdicts each
        assert any(k.startswith("slipstream:judge:serve@v2:direct:") for k in keys)
        assert 0 < await client.redis.ttl(keys[0]) <= 600
    finally:
        for j in (judge, v2, other_model):
            await j.close()
        await client.close()


async def test_an_unreachable_cache_is_a_miss_not_a_failure(server: ScriptedJudge, tmp_path: Path) -> None:
    client = ControlClient("redis://127.0.0.1:9/0", timeout_s=0.2)  # nothing listens on port 9
    judge = make_judge(server, tmp_path, cache=VerdictCache(client, ttl_s=60))
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
        await client.close()
    assert j.unscorable == "" and len(j.scores) == 5 and j.cached == 0
    assert client.healthy is False


# -- Slipstream's own endpoint as the judge ------------------------------------------------------------


async def test_slipstreams_own_endpoint_can_be_the_judge(tmp_path: Path) -> None:
    """The judge speaks plain /v1/chat/completions: a serving worker's endpoint works as one."""
    tok = ByteTokenizer()

    def reply(request: object, prompt: str) -> str:
        return "Short and to the point.\nSCORE: 9" if TEXT["brief"] in prompt else "Partly.\nSCORE: 4"

    engine = ScriptedEngine(tok, reply)
    ep = ServeEndpoint(engine, tok, ServeConfig(enabled=True, port=0, renderer="tags"), MemorySink(), model_name="m")
    await ep.start()
    config = JudgeConfig(
        url=ep.base_url, model="m", envs=["serve"], rubric_file=str(rubric_file(tmp_path)), context="serve", k=0
    )
    judge = Judge.from_config("own", config, api_key="sk-judge")
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
        await ep.close()
    assert j.unscorable == ""
    assert j.scores == pytest.approx({"direct": 0.4, "correct": 0.4, "polite": 0.4, "brief": 0.9, "cites": 0.4})
    assert engine.requests == 5 and len(ep.recorder.calls) == 5


async def test_slipstreams_own_endpoint_continues_a_prefilled_verdict(tmp_path: Path) -> None:
    """A ChatML-rendered endpoint: the model is shown the assistant turn opened with the prefill
    (no end of turn after it) and writes only the number."""
    tok = ByteTokenizer()
    prompts: list[str] = []

    def reply(request: object, prompt: str) -> str:
        prompts.append(prompt)
        return " 8" if prompt.endswith("<|im_start|>assistant\nSCORE:") else "no verdict"

    engine = ScriptedEngine(tok, reply)
    ep = ServeEndpoint(engine, tok, ServeConfig(enabled=True, port=0, renderer="smollm2"), MemorySink(), model_name="m")
    await ep.start()
    config = JudgeConfig(
        url=ep.base_url,
        model="m",
        envs=["serve"],
        rubric_file=str(rubric_file(tmp_path)),
        context="serve",
        k=2,
        prefill="SCORE:",
        max_tokens=4,
    )
    judge = Judge.from_config("own", config, api_key="sk-judge")
    try:
        j = await judge.judge(item())
    finally:
        await judge.close()
        await ep.close()
    assert j.unscorable == "" and list(j.scores.values()) == pytest.approx([0.8, 0.8])
    assert len(prompts) == 2 and all(p.count("<|im_end|>") == 2 for p in prompts)  # system and user turns closed
