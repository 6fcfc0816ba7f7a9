"""Context-1's reward (slipstream.envs.search.reward) against hand-computed values."""

from __future__ import annotations

import pytest

from slipstream.envs.search.reward import (
    RewardConfig,
    annealed_beta,
    f_beta,
    prune_streak_penalty,
    reward,
    scaled_turn_window,
    trajectory_recall,
    turn_penalty,
)

pytestmark = pytest.mark.unit

PRUNE, SEARCH = "prune_chunks", "search_corpus"


def test_f_beta_at_beta_4_and_2() -> None:
    # P = 2/4, R = 2/3. beta 4: 17 * (1/2)(2/3) / (16 * 1/2 + 2/3) = (17/3) / (26/3) = 17/26.
    out, targets = ["a", "b", "c", "d"], {"a", "b", "e"}
    assert f_beta(out, targets, 4.0) == pytest.approx(17 / 26)
    # beta 2: 5 * (1/3) / (4 * 1/2 + 2/3) = (5/3) / (8/3) = 5/8.
    assert f_beta(out, targets, 2.0) == pytest.approx(5 / 8)
    assert f_beta([], targets, 4.0) == 0.0
    assert f_beta(["x"], targets, 4.0) == 0.0
    assert f_beta(["a", "b", "e"], targets, 2.0) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="beta"):
        f_beta(out, targets, 0.0)


def test_beta_anneals_from_4_to_2_between_epochs() -> None:
    assert [annealed_beta(e, 5) for e in range(5)] == pytest.approx([4.0, 3.5, 3.0, 2.5, 2.0])
    assert annealed_beta(0, 1) == 4.0
    with pytest.raises(ValueError, match="epoch"):
        annealed_beta(5, 5)


def test_trajectory_recall_counts_pruned_documents() -> None:
    # b was seen and later pruned: it still counts. e was never seen.
    seen_including_pruned = {"a", "b", "x"}
    assert trajectory_recall(seen_including_pruned, {"a", "b", "e"}) == pytest.approx(2 / 3)
    r = reward(
        output=["a"], targets={"a", "b", "e"}, seen=seen_including_pruned, answer_docs={"e"}, tool_calls=[], turns=3
    )
    assert r.traj_recall == pytest.approx(2 / 3) and r.recall == pytest.approx(1 / 3)


def test_answer_bonus_is_one_when_an_answer_document_is_in_the_output() -> None:
    base = dict(targets={"a", "b"}, seen={"a", "b"}, answer_docs={"b"}, tool_calls=[SEARCH], turns=2)
    without = reward(output=["a"], **base)  # type: ignore[arg-type]
    with_answer = reward(output=["b"], **base)  # type: ignore[arg-type]
    assert not without.final_answer and with_answer.final_answer
    assert with_answer.reward - without.reward == pytest.approx(1.0)
    assert with_answer.components["final_answer"] == pytest.approx(1.0)


@pytest.mark.parametrize(("streak", "penalty"), [(3, 0.0), (4, 0.1), (10, 0.5)])
def test_prune_streak_penalty(streak: int, penalty: float) -> None:
    calls = [SEARCH, *[PRUNE] * streak, SEARCH]
    assert prune_streak_penalty(calls) == pytest.approx(penalty)


def test_prune_streaks_are_summed_and_broken_by_other_calls() -> None:
    # Two streaks of 5 (0.2 each) = 0.4; three of 5 would be 0.6, capped at 0.5.
    assert prune_streak_penalty([*[PRUNE] * 5, SEARCH, *[PRUNE] * 5]) == pytest.approx(0.4)
    assert prune_streak_penalty([*[PRUNE] * 5, SEARCH, *[PRUNE] * 5, SEARCH, *[PRUNE] * 5]) == pytest.approx(0.5)
    assert prune_streak_penalty([PRUNE, SEARCH] * 10) == 0.0


@pytest.mark.parametrize(("turns", "penalty"), [(1, 0.0), (64, 0.0), (96, 0.25), (128, 0.5), (500, 0.5)])
def test_turn_penalty(turns: int, penalty: float) -> None:
    assert turn_penalty(turns) == pytest.approx(penalty)


def test_turn_window_scales_with_the_budget() -> None:
    assert scaled_turn_window(32_768) == (64, 128)
    assert scaled_turn_window(8_192) == (16, 32)
    assert scaled_turn_window(2_048) == (8, 16) == scaled_turn_window(512)  # the floor
    assert turn_penalty(12, start=8, end=16) == pytest.approx(0.25)


def test_floor_then_cap_so_a_penalised_success_beats_a_failure() -> None:
    heavy = [*[PRUNE] * 10]  # 0.5 prune penalty, plus 0.5 turn penalty at 200 turns
    # Found one of two targets (F4 = 17*0.5/16.5), saw both, missed the answer doc:
    # pre = 0.7 * 17/33 + 0.3 = 0.66061; raw = pre - 1.0 < 0 -> the floor 0.01.
    success = reward(output=["a"], targets={"a", "b"}, seen={"a", "b"}, answer_docs={"b"}, tool_calls=heavy, turns=200)
    assert success.pre_penalty == pytest.approx(0.7 * 17 / 33 + 0.3)
    assert success.prune_penalty == pytest.approx(0.5) and success.turn_penalty == pytest.approx(0.5)
    assert success.reward == pytest.approx(0.01)
    # Found nothing: pre = 0 caps the floor, so the failure gets 0, below the penalised success.
    failure = reward(output=[], targets={"a", "b"}, seen=set(), answer_docs={"b"}, tool_calls=[SEARCH], turns=2)
    assert failure.reward == 0.0 and success.reward > failure.reward
    # The cap: a floor above what the trajectory earned does not inflate it.
    small = reward(
        output=["x"],
        targets={"a", "b", "c", "d", "e"},
        seen={"a"},
        answer_docs={"b"},
        tool_calls=heavy,
        turns=200,
        config=RewardConfig(floor=0.5),
    )
    assert small.pre_penalty == pytest.approx(0.3 * 0.2) and small.reward == pytest.approx(0.06)


def test_components_are_named_and_sum_to_the_reward() -> None:
    r = reward(
        output=["a", "z"],
        targets={"a", "b"},
        seen={"a", "b", "z"},
        answer_docs={"a"},
        tool_calls=[SEARCH, *[PRUNE] * 4],
        turns=96,
    )
    c = r.components
    assert set(c) == {"f_beta", "traj_recall", "final_answer", "prune_penalty", "turn_penalty", "clamp"}
    # P = R = 1/2 -> F4 = 1/2. pre = 0.35 + 0.3 + 1.0 = 1.65; penalties 0.1 + 0.25 -> 1.30, no clamp.
    assert c["f_beta"] == pytest.approx(0.35) and c["traj_recall"] == pytest.approx(0.3)
    assert c["prune_penalty"] == pytest.approx(-0.1) and c["turn_penalty"] == pytest.approx(-0.25)
    assert c["clamp"] == pytest.approx(0.0)
    assert r.reward == pytest.approx(1.30) == pytest.approx(sum(c.values()))
