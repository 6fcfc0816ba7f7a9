"""The learner trains on the reward re-weighted at its step: intake screens, advantages, step report.

Episodes shaped like the swarm env's (components perf / parallel / finish summing to the reward,
counts critical_steps / total_steps / subagents) go through the real path: `Intake.offer` and
`take` at a learner step, `step_items` (the advantages) and `Trainer.step` on the tiny model,
then `publish_step` onto the in-memory bus.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator

import pytest
import structlog
import torch

from slipstream.bus import BusConfig, connect_bus, reset_memory_brokers
from slipstream.engine import build_tiny
from slipstream.learner import report
from slipstream.learner.config import LearnerSection
from slipstream.learner.intake import Intake
from slipstream.learner.ledger import TrainedLedger
from slipstream.learner.progress import Progress
from slipstream.learner.report import observe, publish_step
from slipstream.learner.trainer import Trainer, step_items
from slipstream.rl import DropReason, LossConfig
from slipstream.rl.schedule import ComponentSchedule
from slipstream.schemas import (
    Episode,
    LearnerStep,
    PolicySegment,
    Sample,
    ScoredEpisode,
    pack_floats,
    pack_ids,
    pack_mask,
)
from slipstream.schemas.subjects import LEARNER_STEP

pytestmark = pytest.mark.unit

VOCAB = 259
# λ_parallel: 0.5 at step 0, 0.25 at step 2, exactly 0 from step 4 on.
SCHEDULE = {"parallel": ComponentSchedule(init=0.5, anneal_steps=4)}


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def swarm(eid: str, group: str, *, perf: float, parallel: float, counts: dict[str, int] | None = None) -> ScoredEpisode:
    """A one-sample orchestrator episode scored like the swarm env (finish 0)."""
    completion = [60 + len(eid), 61]
    sample = Sample(
        sample_id=f"{eid}/0",
        prompt_len=3,
        token_ids=pack_ids([1, 2, 3, *completion]),
        logprobs=pack_floats([-math.log(259.0)] * 2),
        loss_mask=pack_mask([1, 1]),
        segments=[PolicySegment(0, 2)],
    )
    ep = Episode(
        episode_id=eid,
        task_id=group,
        env="swarm",
        group_id=group,
        group_size=2,
        samples=[sample],
        counts=counts or {},
    )
    comps = {"perf": perf, "parallel": parallel, "finish": 0.0}
    return ScoredEpisode(episode=ep, reward=perf + parallel, components=comps, correct=perf > 0.5)


def intake(schedule: dict[str, ComponentSchedule]) -> Intake[str]:
    return Intake(
        max_staleness=4, group_timeout_s=10.0, vocab_size=VOCAB, ledger=TrainedLedger(3), reward_schedule=schedule
    )


def test_a_group_uniform_as_scored_trains_while_the_bonus_still_weighs() -> None:
    # A solved the task serially; B parallelised and failed: both score 1.0 in total.
    a, b = swarm("a", "g", perf=1.0, parallel=0.0), swarm("b", "g", perf=0.0, parallel=1.0)
    plain = intake({})
    plain.offer(a, "a", version=0, now=0.0)
    drops = plain.offer(b, "b", version=0, now=0.0)
    assert [d.reason for d in drops] == [DropReason.UNIFORM_GROUP] * 2  # no schedule: equal rewards, no signal
    scheduled = intake(SCHEDULE)
    assert scheduled.offer(a, "a", version=0, now=0.0, step=0) == []
    assert scheduled.offer(b, "b", version=0, now=0.0, step=0) == []
    (group,), drops = scheduled.take(1, version=0, step=0)
    assert drops == [] and [m.episode_id for m in group.members] == ["a", "b"]
    section = LearnerSection(reward_schedule=SCHEDULE)
    batch = [[m.scored for m in group.members]]
    # Trained rewards: a = 1, b = λ(t)·1; advantages ±(1 − λ)/2 over both of each episode's tokens.
    for step, lam in ((0, 0.5), (1, 0.375), (2, 0.25), (3, 0.125), (4, 0.0), (9, 0.0)):
        items = step_items(batch, section, step=step)
        assert [i.advantage for i in items] == [(1 - lam) / 2, -(1 - lam) / 2], step
    # The scored episodes are untouched: the re-weighting is a view for the step.
    assert [m.scored.reward for m in group.members] == [1.0, 1.0]


def test_a_group_that_differs_only_in_an_annealed_component_is_dropped_as_uniform() -> None:
    # Both solved it; only A parallelised. While λ > 0 that is a signal, once annealed it is none.
    queued = intake(SCHEDULE)
    queued.offer(swarm("a", "g1", perf=1.0, parallel=0.2), "a", version=0, now=0.0, step=3)
    queued.offer(swarm("b", "g1", perf=1.0, parallel=0.0), "b", version=0, now=0.0, step=3)
    assert queued.ready_groups == 1
    groups, drops = queued.take(1, version=0, step=4)  # taken at the step where λ reached 0
    assert groups == [] and sorted((d.episode_id, d.reason) for d in drops) == [
        ("a", DropReason.UNIFORM_GROUP),
        ("b", DropReason.UNIFORM_GROUP),
    ]
    late = intake(SCHEDULE)  # the same group completing after the anneal is dropped at once
    # 0.3 + 0.6 − 0.6 is 0.29999999999999993 in floats: the re-weighted rewards are exact all the same.
    late.offer(swarm("c", "g2", perf=0.3, parallel=0.6), "c", version=0, now=0.0, step=4)
    drops = late.offer(swarm("d", "g2", perf=0.3, parallel=0.0), "d", version=0, now=0.0, step=4)
    assert [d.reason for d in drops] == [DropReason.UNIFORM_GROUP] * 2 and late.ready_groups == 0
    assert drops[0].detail == "equal rewards at step 4's reward weights {'parallel': 0.0}"


async def test_a_step_reports_lambda_and_the_episode_means_on_learner_step() -> None:
    model, tok = build_tiny("tiny", seed=0)
    schedule = {**SCHEDULE, "finish": ComponentSchedule(init=0.1, anneal_steps=4, shape="cosine")}
    section = LearnerSection(reward_schedule=schedule, lr=1e-3)
    t = Trainer(model, section, LossConfig(), pad_id=tok.pad_id)
    a = swarm("a", "g", perf=1.0, parallel=0.0, counts={"critical_steps": 4, "total_steps": 4})
    b = swarm("b", "g", perf=0.0, parallel=1.0, counts={"critical_steps": 3, "total_steps": 9, "subagents": 3})
    del b.components["finish"]  # a score that does not name a scheduled component: counted, not an error
    stats = t.step([[a, b]], version=0, step=2)
    assert stats.applied
    assert stats.reward_weights == {"finish": pytest.approx(0.05), "parallel": 0.25}
    assert stats.reward_mean == 1.0  # the scored reward's mean, comparable across the anneal
    assert stats.episode_means == {
        "critical_steps": 3.5,
        "total_steps": 6.5,
        "subagents": 1.5,  # a has none recorded: 0 there
        # subagents_finished: no episode has it, so it is left out
        "component.finish": 0.0,
        "component.parallel": 0.5,
        "component.perf": 0.5,
    }
    assert stats.missing_components == {"finish": 1}
    progress = Progress(step=3, version=3)
    report._warned_missing.discard("finish")  # warned once per process: start from "not yet"
    with structlog.testing.capture_logs() as logs:
        observe(stats, progress, held=0)
        observe(stats, progress, held=0)
    line, _ = [r for r in logs if r["event"] == "step"]
    assert line["reward_weights"] == {"finish": 0.05, "parallel": 0.25}
    assert line["episode_means"]["critical_steps"] == 3.5
    warnings = [r for r in logs if r["log_level"] == "warning"]
    assert [(w["component"], w["episodes"]) for w in warnings] == [("finish", 1)]  # once, not per step
    reset_memory_brokers()
    bus = await connect_bus(BusConfig(type="memory", url="memory://reward-schedule"), name="t")
    try:
        await bus.ensure_streams()
        await publish_step(bus, stats, progress, run_id="r", dropped={}, finished_at=0.0)
        reader = bus.subscribe(LEARNER_STEP, LearnerStep, deliver="all")
        try:
            msg = (await asyncio.wait_for(reader.__anext__(), 5.0)).msg
        finally:
            await reader.close()
    finally:
        await bus.close()
        reset_memory_brokers()
    assert msg.step == 3 and msg.reward_weights == stats.reward_weights
    assert msg.episode_means == stats.episode_means


def test_without_a_schedule_a_step_trains_the_scored_reward() -> None:
    a, b = swarm("a", "g", perf=1.0, parallel=0.0), swarm("b", "g", perf=0.0, parallel=0.5)
    items = step_items([[a, b]], LearnerSection(), step=123)
    assert [i.advantage for i in items] == [0.25, -0.25]  # 1.0 vs 0.5: every component at weight 1
