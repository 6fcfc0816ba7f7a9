"""Reward schedules (slipstream.rl.schedule): λ by learner step, exact at the end, and the re-weighted reward."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import pytest

from slipstream.learner.config import LearnerConfig, LearnerSection
from slipstream.rl.schedule import ComponentSchedule, missing_components, reweighted, weights_at
from slipstream.runtime.config import ConfigError, resolve
from slipstream.schemas import Episode, ScoredEpisode

pytestmark = pytest.mark.unit

LENGTHS = (1, 2, 3, 7, 10, 333, 10_000)


@pytest.mark.parametrize("shape", ["linear", "cosine"])
@pytest.mark.parametrize("anneal_steps", LENGTHS)
@pytest.mark.parametrize("start_step", [0, 5])
def test_lambda_is_exactly_final_from_the_end_of_the_anneal_on(shape: str, anneal_steps: int, start_step: int) -> None:
    s = ComponentSchedule(init=0.1, anneal_steps=anneal_steps, shape=shape, start_step=start_step)  # type: ignore[arg-type]
    end = start_step + anneal_steps
    assert s.at(0) == 0.1 and s.at(start_step) == 0.1
    for step in (end, end + 1, end + 17, 10 * end + 1_000_003):
        lam = s.at(step)
        assert lam == 0.0 and math.copysign(1.0, lam) == 1.0  # zero itself, not -0.0 or 1e-18
    assert s.at(end - 1) > 0.0  # still annealing one step before the end
    # Non-zero final too: the value itself, not init + (final - init) rounded.
    t = ComponentSchedule(init=0.7, final=0.3, anneal_steps=anneal_steps, shape=shape)  # type: ignore[arg-type]
    assert t.at(anneal_steps) == 0.3 and t.at(anneal_steps + 1) == 0.3


@pytest.mark.parametrize("shape", ["linear", "cosine"])
@pytest.mark.parametrize("anneal_steps", LENGTHS)
def test_lambda_is_monotone_between_init_and_final(shape: str, anneal_steps: int) -> None:
    down = ComponentSchedule(init=0.1, anneal_steps=anneal_steps, shape=shape, start_step=3)  # type: ignore[arg-type]
    up = ComponentSchedule(init=0.0, final=1.0, anneal_steps=anneal_steps, shape=shape)  # type: ignore[arg-type]
    steps = range(anneal_steps + 6)
    d = [down.at(t) for t in steps]
    u = [up.at(t) for t in steps]
    assert all(a >= b for a, b in itertools.pairwise(d)) and d[0] == 0.1 and d[-1] == 0.0
    assert all(a <= b for a, b in itertools.pairwise(u)) and u[0] == 0.0 and u[-1] == 1.0
    assert all(0.0 <= x <= 0.1 for x in d) and all(0.0 <= x <= 1.0 for x in u)


def test_the_shapes_against_hand_computed_values() -> None:
    lin = ComponentSchedule(init=0.1, anneal_steps=10_000)
    cos = ComponentSchedule(init=0.1, anneal_steps=10_000, shape="cosine")
    assert lin.at(2_500) == pytest.approx(0.075) and lin.at(5_000) == pytest.approx(0.05)
    assert cos.at(5_000) == pytest.approx(0.05)  # half a cosine: the midpoint halfway
    assert cos.at(2_500) == pytest.approx(0.1 * (1 + math.cos(math.pi / 4)) / 2)  # ~0.0854, above the line
    assert cos.at(7_500) == pytest.approx(0.1 * (1 + math.cos(3 * math.pi / 4)) / 2)  # ~0.0146, below it
    jump = ComponentSchedule(init=0.1, anneal_steps=0, start_step=4)
    assert [jump.at(t) for t in range(6)] == [0.1, 0.1, 0.1, 0.1, 0.0, 0.0]
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        lin.at(-1)


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"init": 0.1, "anneal_steps": -1}, "anneal_steps must be >= 0, got -1"),
        ({"init": 0.1, "start_step": -2}, "start_step must be >= 0, got -2"),
        ({"init": 0.1, "shape": "exp"}, "unknown shape 'exp'; valid: linear, cosine"),
        ({"init": math.nan}, "init and final must be finite"),
        ({"init": 0.1, "final": math.inf}, "init and final must be finite"),
    ],
)
def test_a_bad_schedule_is_rejected_naming_the_value(fields: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError) as err:
        ComponentSchedule(**fields)  # type: ignore[arg-type]
    assert needle in str(err.value)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ("init = 0.1\nanneal_steps = -3", "anneal_steps must be >= 0, got -3"),
        ('init = 0.1\nshape = "exp"', "Invalid enum value 'exp'"),
        ("final = 0.0", "missing required field `init`"),
        ("init = 0.1\nanneal = 5", "unknown field `anneal`"),
    ],
)
def test_a_bad_schedule_in_a_config_file_names_the_key(tmp_path: Path, body: str, needle: str) -> None:
    path = tmp_path / "learner.toml"
    path.write_text(f"[learner.reward_schedule.parallel]\n{body}\n")
    with pytest.raises(ConfigError) as err:
        resolve(LearnerConfig, config_file=path, environ={})
    assert needle in str(err.value) and "learner.reward_schedule" in str(err.value)


def test_the_rebuild_defaults_from_a_config_file_and_the_environment(tmp_path: Path) -> None:
    path = tmp_path / "learner.toml"
    path.write_text(
        "[learner.reward_schedule.parallel]\ninit = 0.1\nanneal_steps = 10000\n"
        '[learner.reward_schedule.finish]\ninit = 0.1\nanneal_steps = 10000\nshape = "cosine"\n'
    )
    cfg = resolve(LearnerConfig, config_file=path, environ={})
    sched = cfg.learner.reward_schedule
    assert sched["parallel"] == ComponentSchedule(init=0.1, final=0.0, anneal_steps=10_000, shape="linear")
    assert sched["finish"].shape == "cosine"
    assert weights_at(sched, 0) == {"finish": 0.1, "parallel": 0.1}
    assert weights_at(sched, 10_000) == {"finish": 0.0, "parallel": 0.0}
    env = {"SLIPSTREAM_LEARNER__REWARD_SCHEDULE": '{"parallel": {"init": 0.2, "anneal_steps": 5}}'}
    assert resolve(LearnerConfig, environ=env).learner.reward_schedule["parallel"].at(5) == 0.0
    assert LearnerSection().reward_schedule == {}  # no schedule by default: every component at weight 1
    with pytest.raises(ValueError, match="component name must be a non-empty word"):
        LearnerSection(reward_schedule={" parallel": ComponentSchedule(init=0.1)})
    with pytest.raises(ValueError, match="step_means must name distinct"):
        LearnerSection(step_means=["subagents", "subagents"])


def swarm_score(perf: float, parallel: float, finish: float) -> ScoredEpisode:
    ep = Episode(episode_id="e", task_id="t", env="swarm")
    comps = {"perf": perf, "parallel": parallel, "finish": finish}
    return ScoredEpisode(episode=ep, reward=perf + parallel + finish, components=comps)


def test_the_reward_trained_on_re_weights_the_named_components_by_step() -> None:
    sched = {
        "parallel": ComponentSchedule(init=0.1, anneal_steps=100),
        "finish": ComponentSchedule(init=0.1, anneal_steps=100, shape="cosine"),
    }
    s = swarm_score(1.0, 0.5, 0.25)  # scored reward 1.75: every component at weight 1

    def at(step: int) -> float:
        return reweighted(s.reward, s.components, weights_at(sched, step))

    assert at(0) == pytest.approx(1.0 + 0.1 * 0.5 + 0.1 * 0.25)  # 1.075
    assert at(50) == pytest.approx(1.0 + 0.05 * 0.5 + 0.05 * 0.25)  # both at 0.05 halfway (the cosine's midpoint)
    assert at(25) == pytest.approx(1.0 + 0.075 * 0.5 + 0.1 * (1 + math.cos(math.pi / 4)) / 2 * 0.25)
    assert at(100) == 1.0 and at(5_000) == 1.0  # r_perf alone, exactly, once annealed
    # Without a schedule (or at weight 1) the scored reward itself, bit for bit.
    assert reweighted(s.reward, s.components, {}) == s.reward
    assert reweighted(s.reward, s.components, {"perf": 1.0}) == s.reward
    # A component re-weighted upwards, another untouched (perf stays at 1 without a schedule).
    assert reweighted(s.reward, s.components, {"parallel": 3.0}) == pytest.approx(1.0 + 1.5 + 0.25)


def test_an_annealed_component_leaves_exactly_the_other_components() -> None:
    s = swarm_score(0.3, 0.6, 0.0)  # scored 0.3 + 0.6 = 0.8999999999999999
    assert s.reward - 0.6 != 0.3  # the literal formula drifts: 0.29999999999999993
    assert reweighted(s.reward, s.components, {"parallel": 0.0}) == 0.3
    assert reweighted(s.reward, s.components, {"parallel": 0.0, "perf": 0.0}) == 0.0
    assert reweighted(s.reward, s.components, {"parallel": 0.5}) == pytest.approx(0.6)
    # Components that do not sum to the reward (a scorer with an unnamed remainder): the formula itself.
    assert reweighted(2.0, {"perf": 1.0, "parallel": 0.5}, {"parallel": 0.0}) == 1.5


def test_a_scheduled_component_missing_from_a_score_counts_zero() -> None:
    ep = Episode(episode_id="e", task_id="t", env="search")
    s = ScoredEpisode(episode=ep, reward=0.8, components={"perf": 0.8})
    weights = {"parallel": 0.1, "finish": 0.1}
    assert reweighted(s.reward, s.components, weights) == 0.8
    assert missing_components(s.components, weights) == ["parallel", "finish"]
    assert missing_components(swarm_score(1, 0, 0).components, weights) == []
