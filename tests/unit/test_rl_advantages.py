"""Group advantages, uniform-group detection and the staleness admission rule, on hand-computed values."""

from __future__ import annotations

import pytest
import torch

from slipstream.rl import DropReason, group_advantages, is_stale, is_uniform_group, staleness

pytestmark = pytest.mark.unit


def values(t: torch.Tensor) -> list[float]:
    return [round(x, 6) for x in t.tolist()]


# --- advantages ---------------------------------------------------------------------------------


def test_advantage_is_reward_minus_group_mean() -> None:
    # mean(1, 0, 0, 1) = 0.5 -> A = (0.5, -0.5, -0.5, 0.5)
    assert values(group_advantages([1.0, 0.0, 0.0, 1.0])) == [0.5, -0.5, -0.5, 0.5]
    # mean(3, 1, 2) = 2 -> A = (1, -1, 0)
    assert values(group_advantages(torch.tensor([3.0, 1.0, 2.0]))) == [1.0, -1.0, 0.0]


def test_advantages_sum_to_zero_and_scale_with_rewards_without_std() -> None:
    a = group_advantages([0.2, 0.9, 0.4])  # mean 0.5 -> (-0.3, 0.4, -0.1)
    assert values(a) == [-0.3, 0.4, -0.1]
    assert abs(float(a.sum())) < 1e-6
    # Dr. GRPO: scaling rewards by c scales advantages by c (std normalisation would undo it).
    assert values(group_advantages([2.0, 0.0, 0.0, 2.0])) == [1.0, -1.0, -1.0, 1.0]


def test_std_normalisation_divides_by_population_std() -> None:
    # (1, 0, 0, 1): centred (0.5, -0.5, -0.5, 0.5), population std 0.5 -> (1, -1, -1, 1) up to eps.
    a = group_advantages([1.0, 0.0, 0.0, 1.0], normalize_std=True, eps=1e-6)
    assert a.tolist() == pytest.approx([1.0, -1.0, -1.0, 1.0], rel=1e-5)
    # With std normalisation the scale of the rewards no longer matters.
    b = group_advantages([2.0, 0.0, 0.0, 2.0], normalize_std=True)
    assert b.tolist() == pytest.approx(a.tolist(), rel=1e-5)
    # (3, 1, 2): centred (1, -1, 0), std sqrt(2/3) = 0.816497 -> (1.224745, -1.224745, 0)
    c = group_advantages([3.0, 1.0, 2.0], normalize_std=True)
    assert c.tolist() == pytest.approx([1.224745, -1.224745, 0.0], abs=1e-5)


def test_one_element_group_has_zero_advantage_not_nan() -> None:
    assert group_advantages([0.7]).tolist() == [0.0]
    assert group_advantages([0.7], normalize_std=True).tolist() == [0.0]


def test_uniform_group_gives_zero_advantages_even_with_std() -> None:
    assert group_advantages([1.0, 1.0, 1.0]).tolist() == [0.0, 0.0, 0.0]
    assert group_advantages([1.0, 1.0, 1.0], normalize_std=True).tolist() == [0.0, 0.0, 0.0]


def test_integer_tensor_rewards_become_float() -> None:
    a = group_advantages(torch.tensor([1, 0]))
    assert a.dtype == torch.float32
    assert a.tolist() == [0.5, -0.5]


def test_uniform_group_detection() -> None:
    assert is_uniform_group([1.0, 1.0, 1.0, 1.0])
    assert is_uniform_group([0.0])  # a lone sample has nothing to compare against
    assert not is_uniform_group([1.0, 1.0, 0.0])
    # spread 1e-7: uniform only when the tolerance allows it
    assert not is_uniform_group([0.5, 0.5000001])
    assert is_uniform_group([0.5, 0.5000001], tol=1e-6)


@pytest.mark.parametrize(
    ("rewards", "message"),
    [
        ([], "empty"),
        ([1.0, float("nan")], "finite"),
        ([0.0, float("inf")], "finite"),
        (torch.zeros(2, 2), "1-D"),
    ],
)
def test_bad_rewards_are_rejected(rewards: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        group_advantages(rewards)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=message):
        is_uniform_group(rewards)  # type: ignore[arg-type]


def test_negative_tolerance_is_rejected() -> None:
    with pytest.raises(ValueError, match="tol"):
        is_uniform_group([1.0, 1.0], tol=-0.1)


# --- staleness ----------------------------------------------------------------------------------


def test_staleness_counts_versions_behind() -> None:
    assert staleness(5, 5) == 0
    assert staleness(3, 5) == 2
    assert staleness(0, 7) == 7


def test_max_staleness_zero_admits_only_current_version() -> None:
    assert not is_stale(5, 5, max_staleness=0)
    assert is_stale(4, 5, max_staleness=0)


def test_max_staleness_bound_is_inclusive() -> None:
    current, max_staleness = 10, 2
    assert not is_stale(10, current, max_staleness)  # 0 behind
    assert not is_stale(8, current, max_staleness)  # exactly max behind: kept
    assert is_stale(7, current, max_staleness)  # max + 1 behind: dropped


@pytest.mark.parametrize(
    ("oldest", "current", "message"),
    [
        (-1, 5, "oldest_version"),  # Trajectory.oldest_version() of a trajectory without segments
        (0, -2, "current_version"),
        (6, 5, "ahead"),
    ],
)
def test_impossible_versions_are_errors(oldest: int, current: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        staleness(oldest, current)


def test_negative_max_staleness_is_rejected() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        is_stale(5, 5, max_staleness=-1)


def test_drop_reasons_are_plain_string_keys() -> None:
    dropped = {DropReason.STALE: 2, DropReason.UNIFORM_GROUP: 1}
    assert dropped["stale"] == 2
    assert {str(r) for r in DropReason} >= {"stale", "uniform_group", "malformed", "duplicate"}
