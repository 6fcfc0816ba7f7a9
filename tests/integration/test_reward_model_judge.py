"""The reward-model with a rubric judge, over a real nats-server, a real Redis and a scripted judge.

Raw episodes go in on traj.raw.arith; the service scores them with the arith verifier and asks
the judge (the real `openai` client to tests/scripted_judge.py over loopback) about K of the
rubric set's rubrics; what comes out on traj.scored.arith is read back on the learner's durable.
A judge that never gives a usable verdict marks its episode unscorable, and the learner's own
intake drops it with reason `unscorable` while the rest of its group trains against the
survivors' baseline.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from scripted_judge import Call, Reply, ScriptedJudge, score
from test_reward_model import read_scored, running, until

from slipstream.bus import BusConfig, connect_bus
from slipstream.judge import JudgeConfig, load_rubric_sets, sample_rubrics
from slipstream.learner.intake import Intake
from slipstream.learner.ledger import TrainedLedger
from slipstream.reward_model.config import RewardModelConfig, RewardSection
from slipstream.reward_model.service import UNSCORABLE, RewardModelService
from slipstream.rl import DropReason, agent_advantages
from slipstream.runtime.section import ServiceSection
from slipstream.schemas import PolicySegment, Trajectory, pack_floats, pack_ids, pack_mask
from slipstream.stack import Server
from slipstream.store.config import StoreConfig

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

RUBRICS = """
[[rubric_set]]
context = "arith"
version = "v1"
[[rubric_set.rubrics]]
id = "bare"
text = "The answer is a bare number."
[[rubric_set.rubrics]]
id = "newline"
text = "The answer ends with a newline."
weight = 2
[[rubric_set.rubrics]]
id = "short"
text = "The answer is short."
"""
SCORES = {"The answer is a bare number.": 10, "The answer ends with a newline.": 5, "The answer is short.": 8}
ANSWERS = {"a": "8\n", "b": "7", "c": "8 apples"}  # verifier rewards 1.1, 0.1, 1.0


def raw(tid: str, completion: str) -> Trajectory:
    n = 3
    return Trajectory(
        trajectory_id=tid,
        task_id="t:4+4",
        env="arith",
        group_id="t:4+4/g",
        group_size=len(ANSWERS),
        prompt_len=3,
        token_ids=pack_ids([1, 2, 3, 10, 11, 12]),
        logprobs=pack_floats([-1.0] * n),
        loss_mask=pack_mask([1] * n),
        segments=[PolicySegment(0, n)],
        completion_text=completion,
        reference="8",
        metadata={"prompt": "What is 4+4?"},
    )


def judged_config(url: str, tmp_path: Path, redis_url: str, judge: JudgeConfig) -> RewardModelConfig:
    return RewardModelConfig(
        service=ServiceSection(run_id="test", replica="rm-j", redis_url=redis_url),
        bus=BusConfig(url=url, fetch_timeout_s=0.2),
        store=StoreConfig(root=str(tmp_path / "store")),
        reward=RewardSection(concurrency=8, judges={"helpful": judge}),
    )


@pytest.fixture
async def judge_server() -> AsyncIterator[ScriptedJudge]:
    srv = await ScriptedJudge(lambda c: score(SCORES[c.rubric])).start()
    yield srv
    await srv.close()


def judge_cfg(srv: ScriptedJudge, tmp_path: Path, **kw: Any) -> JudgeConfig:
    path = tmp_path / "rubrics.toml"
    path.write_text(RUBRICS)
    base: dict[str, Any] = {"k": 2, "weight": 0.5, "timeout_s": 5.0, "backoff_s": 0.01}
    return JudgeConfig(
        url=srv.url, model="judge-7b", envs=["arith"], rubric_file=str(path), context="arith", **{**base, **kw}
    )


async def test_episodes_get_a_weighted_judge_component_with_provenance_and_cache_hits(
    nats_server: Server, redis_server: Server, judge_server: ScriptedJudge, tmp_path: Path
) -> None:
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    cfg = judge_cfg(judge_server, tmp_path, cache=True)
    rubric_set = load_rubric_sets(cfg.rubric_file)[0]
    try:
        svc = RewardModelService(judged_config(nats_server.url, tmp_path, redis_server.url, cfg))
        async with running(svc):
            for tid, text in ANSWERS.items():
                await bus.publish("traj.raw.arith", raw(tid, text), msg_id=tid)
            scored = {s.episode.episode_id: s for s in await read_scored(bus, 3)}
            assert len(judge_server.calls) == 6  # K = 2 rubrics per episode
            # The same episode again (a worker retry): scored again, its verdicts from Redis.
            await bus.publish("traj.raw.arith", raw("a", ANSWERS["a"]), msg_id="retry-of-a")
            await until(lambda: _done(svc, 4), 15, "the retry scored")
            status = svc.status()
        assert len(judge_server.calls) == 6, "the retried episode's verdicts were not served from the cache"
        assert status["judges"]["helpful"]["cache_hits"] == 2
        assert status["judges"]["helpful"]["rubric_set"] == "arith@v1" and status["unscorable"] == 0
        assert status["judge_cache"]["healthy"] is True and status["judge_cache"]["url"] == redis_server.url
        verifier = {"a": 1.1, "b": 0.1, "c": 1.0}
        weights = {"bare": 1.0, "newline": 2.0, "short": 1.0}
        points = {"bare": 1.0, "newline": 0.5, "short": 0.8}
        for tid, s in scored.items():
            (j,) = s.judgements
            ids = [r.id for r in sample_rubrics(rubric_set, 2, tid)]
            assert (j.judge, j.model, j.rubric_set, j.rubric_ids) == ("helpful", "judge-7b", "arith@v1", ids)
            assert j.scores == pytest.approx({r: points[r] for r in ids}) and j.failures == {}
            mean = sum(points[r] * weights[r] for r in ids) / sum(weights[r] for r in ids)
            assert j.aggregate == pytest.approx(mean)
            assert s.components["judge"] == pytest.approx(0.5 * mean)
            assert s.reward == pytest.approx(verifier[tid] + 0.5 * mean)
            assert s.unscorable == "" and s.scorer_version == "arith@1+helpful:judge-7b:arith@v1"
        # The judge saw the task text the episode carried and the episode's final answer.
        asked = judge_server.calls[0].messages[-1]["content"]
        assert "<task>\nWhat is 4+4?\n</task>" in asked and "<reference>\n8\n</reference>" in asked
    finally:
        await bus.close()


async def _done(svc: RewardModelService, n: int, unscorable: int = 0) -> bool:
    return svc.status()["scored"] >= n and svc.status()["unscorable"] >= unscorable


def malformed_for_seven(call: Call) -> Reply:
    if call.response == "7":
        return Reply(text="Hard to say.")
    return score(SCORES[call.rubric])


async def test_a_judge_without_usable_verdicts_marks_the_episode_and_the_learner_drops_it(
    nats_server: Server, judge_server: ScriptedJudge, tmp_path: Path
) -> None:
    judge_server.script = malformed_for_seven
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    before = UNSCORABLE.value(env="arith")
    # No cache and no Redis: a judge without `cache` needs neither.
    cfg = judge_cfg(judge_server, tmp_path, k=0, parse_retries=1, cache=False)
    try:
        svc = RewardModelService(judged_config(nats_server.url, tmp_path, "", cfg))
        async with running(svc):
            for tid, text in ANSWERS.items():
                await bus.publish("traj.raw.arith", raw(tid, text), msg_id=tid)
            scored = await read_scored(bus, 3)
            await until(lambda: _done(svc, 2, unscorable=1), 10, "the counts")  # counted after the publish
            status = svc.status()
        assert (status["scored"], status["unscorable"]) == (2, 1)
        assert UNSCORABLE.value(env="arith") - before == 1
        by_id = {s.episode.episode_id: s for s in scored}
        bad = by_id["b"]
        assert bad.unscorable.startswith("judge helpful: 0 of 3 rubrics scored, 3 needed: bare: malformed")
        assert "judge" not in bad.components and bad.reward == pytest.approx(0.1)  # the verifier's, untouched
        assert bad.judgements[0].failures == {"bare": "malformed", "newline": "malformed", "short": "malformed"}
        assert len([c for c in judge_server.calls if c.response == "7"]) == 3 * 2  # each asked, re-asked once

        # The learner's intake, fed what the reward-model published.
        intake: Intake[str] = Intake(max_staleness=2, group_timeout_s=60, vocab_size=259, ledger=TrainedLedger(3))
        drops = [d for s in scored for d in intake.offer(s, s.episode.episode_id, version=0, now=0.0)]
        assert [(d.episode_id, d.reason) for d in drops] == [("b", DropReason.UNSCORABLE)]
        assert intake.dropped == {"unscorable": 1}
        (group,), _ = intake.take(1, version=0)
        survivors = sorted((m.scored for m in group.members), key=lambda s: s.episode.episode_id)
        assert [s.episode.episode_id for s in survivors] == ["a", "c"]
        rewards = [s.reward for s in survivors]
        baseline = sum(rewards) / 2  # the survivors' mean: b's reward takes no part
        advantages = [next(iter(a.values())) for a in agent_advantages(survivors)]
        assert advantages == pytest.approx([r - baseline for r in rewards], abs=1e-6)  # float32 advantages
        assert advantages[0] == pytest.approx((1.1 + 0.5 * (1.0 + 1.0 + 0.8) / 4) - baseline, abs=1e-6)
    finally:
        await bus.close()


async def test_slow_judging_overlaps_across_episodes(
    nats_server: Server, judge_server: ScriptedJudge, tmp_path: Path
) -> None:
    """Judge calls are awaited on the loop, not in a thread per episode: episodes are judged at once."""
    judge_server.script = lambda c: Reply(text="SCORE: 6", delay_s=0.4)
    bus = await connect_bus(BusConfig(url=nats_server.url), name="test")
    await bus.ensure_streams()
    cfg = judge_cfg(judge_server, tmp_path, k=1, concurrency=16, cache=False)
    try:
        svc = RewardModelService(judged_config(nats_server.url, tmp_path, "", cfg))
        async with running(svc):
            for i in range(8):
                await bus.publish("traj.raw.arith", raw(f"e{i}", "8\n"), msg_id=f"e{i}")
            scored = await read_scored(bus, 8)
        assert len(scored) == 8 and all(s.components["judge"] == pytest.approx(0.3) for s in scored)
        # One call per episode, 0.4 s each: with `[reward] concurrency` 8 they were in flight together.
        assert len(judge_server.calls) == 8 and judge_server.max_in_flight >= 4
    finally:
        await bus.close()
