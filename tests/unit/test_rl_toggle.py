"""Toggle's budget rule (slipstream.rl.toggle) on hand-computed values, and the learner intake's hook.

Percentiles are checked against numpy's default (linear) method by hand: for [3, 5, 20, 40] the
25th percentile sits at position 0.75 between 3 and 5, so 4.5.
"""

from __future__ import annotations

import math

import msgspec
import pytest

from slipstream.learner.config import LearnerSection
from slipstream.learner.intake import Intake, toggle_key
from slipstream.learner.ledger import TrainedLedger
from slipstream.rl import DropReason
from slipstream.rl.toggle import Budgets, ToggleConfig, percentile, toggle_rewards, tokens_per_correct
from slipstream.schemas import Episode, PolicySegment, Sample, ScoredEpisode, pack_floats, pack_ids, pack_mask

pytestmark = pytest.mark.unit


def test_percentile_is_linear_between_order_statistics() -> None:
    assert percentile([40, 3, 20, 5], 25.0) == 4.5  # position 0.75 between 3 and 5
    assert percentile([40, 3, 20, 5], 50.0) == 12.5  # position 1.5 between 5 and 20
    assert percentile([40, 3, 20, 5], 0.0) == 3.0
    assert percentile([40, 3, 20, 5], 100.0) == 40.0
    assert percentile([7], 30.0) == 7.0
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50.0)


def test_phases_alternate_every_period_steps_starting_with_the_budget_phase() -> None:
    cfg = ToggleConfig(enabled=True, period=3)
    assert [cfg.budget_phase(t) for t in range(8)] == [True, True, True, False, False, False, True, True]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"period": 0}, "period must be >= 1 step, got 0"), ({"rho": 101.0}, "rho"), ({"accuracy": -0.1}, "λ")],
)
def test_bad_settings_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ToggleConfig(**kwargs)  # type: ignore[arg-type]


def test_an_over_budget_answer_scores_zero_once_the_group_is_accurate_enough() -> None:
    rewards, correct, lengths = [1.0, 1.0, 1.0, 0.0], [True, True, True, False], [3, 20, 5, 2]
    # accuracy 3/4 >= λ 0.5: the 20-token answer is over the budget of 5 and loses its reward.
    out = toggle_rewards(rewards, correct, lengths, budget=5.0, accuracy=0.5, budget_phase=True)
    assert out == [1.0, 0.0, 1.0, 0.0]
    # accuracy 3/4 < λ 0.8: the budget does not bite yet.
    assert toggle_rewards(rewards, correct, lengths, budget=5.0, accuracy=0.8, budget_phase=True) == rewards
    # the free phase, or no budget measured yet: the rewards as scored.
    assert toggle_rewards(rewards, correct, lengths, budget=5.0, accuracy=0.5, budget_phase=False) == rewards
    assert toggle_rewards(rewards, correct, lengths, budget=None, accuracy=0.5, budget_phase=True) == rewards
    # exactly at the budget is within it (|y| <= budget).
    assert toggle_rewards([1.0], [True], [5], budget=5.0, accuracy=1.0, budget_phase=True) == [1.0]
    with pytest.raises(ValueError, match="2 rewards, 1 correct flags and 2 lengths differ"):
        toggle_rewards([1.0, 1.0], [True], [1, 2], budget=1.0, accuracy=0.5, budget_phase=True)


def test_a_budget_is_frozen_when_first_measured() -> None:
    budgets = Budgets(rho=25.0)
    assert budgets.measure("arith/1+2", [False, False], [3, 30]) is None  # nothing correct: not measured
    assert len(budgets) == 0
    # Correct lengths [3, 5, 20, 40] (the wrong 2 does not count): the 25th percentile is 4.5.
    assert budgets.measure("arith/1+2", [True, True, False, True, True], [40, 3, 2, 20, 5]) == 4.5
    # A later, terser group does not move it.
    assert budgets.measure("arith/1+2", [True, True], [2, 2]) == 4.5
    assert budgets.frozen == {"arith/1+2": 4.5}


def test_tokens_per_correct_counts_correct_answers_only() -> None:
    assert tokens_per_correct([3, 20, 5, 2], [True, True, True, False]) == pytest.approx(28 / 3)
    assert tokens_per_correct([4], [False]) == 0.0


# -- the learner's intake --------------------------------------------------------------------------

VOCAB = 259
TOGGLE = ToggleConfig(enabled=True, period=2, rho=50.0, accuracy=0.5)


def scored(eid: str, group: str, *, n_tokens: int, correct: bool, key: str = "1+2") -> ScoredEpisode:
    """A one-sample chatty episode of `n_tokens` sampled tokens, reward 1 when correct."""
    completion = [60 + (len(eid) + i) % 100 for i in range(n_tokens)]
    sample = Sample(
        sample_id=f"{eid}/0",
        prompt_len=3,
        token_ids=pack_ids([1, 2, 3, *completion]),
        logprobs=pack_floats([-math.log(259.0)] * n_tokens),
        loss_mask=pack_mask([1] * n_tokens),
        segments=[PolicySegment(0, n_tokens)],
    )
    ep = Episode(
        episode_id=eid,
        task_id=group,
        env="chatty",
        group_id=group,
        group_size=4,
        samples=[sample],
        metadata={"key": key},
    )
    r = 1.0 if correct else 0.0
    return ScoredEpisode(episode=ep, reward=r, components={"correct": r, "format": 0.0}, correct=correct)


def fill(intake: Intake[str], group: str, shape: list[tuple[int, bool]], *, step: int) -> list[str]:
    drops: list[str] = []
    for i, (n, ok) in enumerate(shape):
        drops += [
            d.reason
            for d in intake.offer(scored(f"{group}-{i}", group, n_tokens=n, correct=ok), "h", 0, 0.0, step=step)
        ]
    return drops


def make(toggle: ToggleConfig | None) -> Intake[str]:
    return Intake(max_staleness=4, group_timeout_s=10.0, vocab_size=VOCAB, ledger=TrainedLedger(3), toggle=toggle)


def test_the_intake_trains_a_uniform_all_correct_group_in_the_budget_phase() -> None:
    # All four right, two terse (2 tokens) and two padded (24): uniform as scored, dropped without Toggle.
    shape = [(2, True), (24, True), (2, True), (24, True)]
    plain = make(None)
    assert fill(plain, "g", shape, step=0) == [DropReason.UNIFORM_GROUP] * 4
    on = make(TOGGLE)
    assert fill(on, "g", shape, step=0) == []
    assert on.budgets.frozen == {"chatty/1+2": 13.0}  # median of [2, 2, 24, 24]
    (group,), drops = on.take(1, version=0, step=1)  # step 1: still the budget phase (period 2)
    trained = on.trained(group, step=1)
    assert drops == [] and [s.reward for s in trained] == [1.0, 0.0, 1.0, 0.0]
    assert [s.components for s in trained][1] == {"correct": 0.0, "format": 0.0}  # a reward schedule cannot revive it
    assert [m.scored.reward for m in group.members] == [1.0] * 4  # the scored episodes are untouched
    assert on.toggled == 2


def test_the_free_phase_and_a_low_accuracy_group_train_as_scored() -> None:
    on = make(TOGGLE)
    # Budget measured at step 2 (free phase): frozen at 13 all the same, but the group is uniform now.
    assert fill(on, "g1", [(2, True), (24, True), (2, True), (24, True)], step=2) == [DropReason.UNIFORM_GROUP] * 4
    assert on.budgets.frozen == {"chatty/1+2": 13.0}
    # One right of four (0.25 < λ): the padded right answer keeps its reward in the budget phase.
    assert fill(on, "g2", [(24, True), (2, False), (2, False), (3, False)], step=4) == []
    (group,), _ = on.take(1, version=0, step=4)
    assert [s.reward for s in on.trained(group, step=4)] == [1.0, 0.0, 0.0, 0.0] and on.toggled == 0


def test_toggle_keys_follow_the_problem_key_across_groups() -> None:
    s = scored("a", "task-17", n_tokens=2, correct=True, key="3+4")
    assert toggle_key(s) == "chatty/3+4"
    bare = msgspec.structs.replace(s, episode=msgspec.structs.replace(s.episode, metadata={}))
    assert toggle_key(bare) == "chatty/task-17"


def test_the_learner_config_reads_the_toggle_table() -> None:
    section = msgspec.convert({"toggle": {"enabled": True, "period": 5, "rho": 25.0}}, LearnerSection)
    assert section.toggle == ToggleConfig(enabled=True, period=5, rho=25.0, accuracy=0.5)
    assert LearnerSection().toggle.enabled is False
    with pytest.raises(msgspec.ValidationError, match="period must be >= 1"):
        msgspec.convert({"toggle": {"period": 0}}, LearnerSection)
