"""eval-gate's promotion rule on constructed score sets, against hand-computed numbers."""

from __future__ import annotations

import math

import pytest

from slipstream.eval_gate.decision import decide, mean_ci, t_cdf, t_quantile

pytestmark = pytest.mark.unit

T_975_DF4 = 2.7764451051977987  # Student t, two-sided 95 %, 4 degrees of freedom (tables: 2.776445)
RULE = {"margin": 0.05, "confidence": 0.95, "floor": 0.40, "min_samples": 5}

HIGH = [0.6, 0.7, 0.8, 0.9, 1.0]  # mean 0.8, sample sd sqrt(0.025)
LOW = [0.5, 0.5, 0.6, 0.7, 0.7]  # mean 0.6; HIGH - LOW = [0.1, 0.2, 0.2, 0.2, 0.3]: mean 0.2, sd sqrt(0.005)


def half_width(sd: float, n: int, t: float = T_975_DF4) -> float:
    return t * sd / math.sqrt(n)


def test_clear_win_is_promoted_with_every_number_checked() -> None:
    d = decide(HIGH, LOW, baseline_version=7, **RULE)
    assert d.promote is True and d.decision == "promote"
    assert d.n == 5
    assert d.score == pytest.approx(0.8)
    hw = half_width(math.sqrt(0.025), 5)  # 0.196324
    assert d.ci_low == pytest.approx(0.8 - hw, abs=1e-9) and d.ci_high == pytest.approx(0.8 + hw, abs=1e-9)
    assert d.ci_low == pytest.approx(0.603676, abs=1e-6)
    assert d.baseline_score == pytest.approx(0.6)
    dhw = half_width(math.sqrt(0.005), 5)  # 0.087799
    assert d.diff_mean == pytest.approx(0.2)
    assert d.diff_ci_low == pytest.approx(0.2 - dhw, abs=1e-9)
    assert d.diff_ci_high == pytest.approx(0.2 + dhw, abs=1e-9)
    assert d.diff_ci_low == pytest.approx(0.112201, abs=1e-6)
    assert d.reason == (
        "promote: score 0.80 (CI 0.60..1.00) >= floor 0.40; "
        "diff vs promoted v7 +0.20 (CI 0.11..0.29) within margin 0.05"
    )


def test_clear_loss_is_rejected_naming_the_promoted_version_and_the_numbers() -> None:
    d = decide(LOW, HIGH, baseline_version=7, **RULE)
    assert d.promote is False and d.decision == "reject"
    assert d.score == pytest.approx(0.6)
    assert d.diff_mean == pytest.approx(-0.2)
    assert d.diff_ci_low == pytest.approx(-0.287799, abs=1e-6)
    assert d.diff_ci_high == pytest.approx(-0.112201, abs=1e-6)
    assert d.reason == "worse than promoted v7 beyond margin: diff CI low -0.29 < -0.05"


def test_tie_within_margin_is_promoted() -> None:
    base = [0.5, 0.6, 0.7, 0.8, 0.9]
    diffs = [0.01, -0.01, 0.0, 0.02, -0.02]  # mean 0, sd sqrt(2.5e-4)
    cand = [b + e for b, e in zip(base, diffs, strict=True)]
    d = decide(cand, base, **RULE)
    assert d.promote is True
    assert d.diff_mean == pytest.approx(0.0, abs=1e-12)
    hw = half_width(math.sqrt(2.5e-4), 5)  # 0.019632
    assert d.diff_ci_low == pytest.approx(-hw, abs=1e-9)
    assert d.diff_ci_high == pytest.approx(hw, abs=1e-9)
    assert "diff vs promoted version +0.00 (CI -0.02..0.02) within margin 0.05" in d.reason


def test_identical_scores_are_a_tie_with_a_zero_width_interval() -> None:
    d = decide(HIGH, HIGH, **RULE)
    assert d.promote is True
    assert (d.diff_mean, d.diff_ci_low, d.diff_ci_high) == (0.0, 0.0, 0.0)


def test_noisy_tie_is_rejected_because_worse_beyond_margin_cannot_be_ruled_out() -> None:
    base = [0.5] * 6
    cand = [0.2, 0.8, 0.2, 0.8, 0.2, 0.8]  # diff mean 0, sd 0.3286: CI reaches far below -0.05
    d = decide(cand, base, **{**RULE, "min_samples": 6})
    assert d.promote is False
    assert d.diff_mean == pytest.approx(0.0, abs=1e-12)
    assert d.diff_ci_low is not None and d.diff_ci_low < -0.3
    assert d.reason.startswith("worse than promoted version beyond margin: diff CI low -0.34 < -0.05")


def test_boundary_diff_ci_low_equal_to_minus_margin_promotes() -> None:
    d0 = decide(LOW, HIGH, **RULE)
    assert d0.diff_ci_low is not None
    at = decide(LOW, HIGH, **{**RULE, "margin": -d0.diff_ci_low})
    below = decide(LOW, HIGH, **{**RULE, "margin": -d0.diff_ci_low - 1e-9})
    assert at.promote is True and below.promote is False


def test_below_floor_is_rejected_even_when_better_than_baseline() -> None:
    cand = [0.30, 0.32, 0.31, 0.29, 0.33]  # mean 0.31
    base = [0.1] * 5
    d = decide(cand, base, **RULE)
    assert d.promote is False
    assert d.score == pytest.approx(0.31)
    assert d.diff_mean == pytest.approx(0.21)
    assert d.reason == "below floor: 0.31 < 0.40"


def test_below_floor_prints_enough_digits_to_show_the_difference() -> None:
    d = decide([0.399, 0.399, 0.398, 0.4, 0.399], None, **RULE)  # mean 0.399
    assert d.promote is False
    assert d.reason == "below floor: 0.399 < 0.400"


def test_too_few_samples_is_rejected_whatever_the_scores() -> None:
    d = decide([1.0] * 12, [0.0] * 12, **{**RULE, "min_samples": 30})
    assert d.promote is False
    assert d.reason == "too few samples: 12 < 30"
    assert d.n == 12 and d.score == 1.0 and d.diff_mean == 1.0


def test_no_samples_at_all_is_too_few_with_undefined_numbers() -> None:
    d = decide([], None, **RULE)
    assert d.promote is False and d.reason == "too few samples: 0 < 5"
    assert math.isnan(d.score) and math.isnan(d.ci_low) and math.isnan(d.ci_high)


def test_first_version_without_baseline_is_judged_on_the_floor_only() -> None:
    d = decide(HIGH, None, **RULE)
    assert d.promote is True
    assert d.diff_mean is None and d.diff_ci_low is None and d.diff_ci_high is None and d.baseline_score is None
    assert d.reason == "promote: score 0.80 (CI 0.60..1.00) >= floor 0.40; no promoted version to compare with"


def test_higher_confidence_widens_the_interval() -> None:
    d95 = decide(HIGH, LOW, **RULE)
    d99 = decide(HIGH, LOW, **{**RULE, "confidence": 0.99})
    assert d99.ci_low < d95.ci_low and d99.ci_high > d95.ci_high
    t99 = 4.604094871415897  # t(0.995, 4); tables: 4.604095
    assert d99.ci_low == pytest.approx(0.8 - half_width(math.sqrt(0.025), 5, t99), abs=1e-9)


def test_unequal_lengths_are_an_error_naming_both_counts() -> None:
    with pytest.raises(ValueError, match="5 candidate scores vs 4 baseline scores"):
        decide(HIGH, LOW[:4], **RULE)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"confidence": 1.0}, "confidence must be in"),
        ({"margin": -0.1}, "margin must be"),
        ({"min_samples": 1}, "min_samples must be >= 2"),
        ({"floor": math.nan}, "floor must be a number"),
    ],
)
def test_bad_settings_are_errors(override: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        decide(HIGH, LOW, **{**RULE, **override})


def test_non_finite_scores_are_an_error_naming_the_index() -> None:
    with pytest.raises(ValueError, match="baseline scores must be finite; index 2 is nan"):
        decide(HIGH, [0.5, 0.5, math.nan, 0.7, 0.7], **RULE)


def test_mean_ci_of_one_value_has_undefined_bounds() -> None:
    mean, lo, hi = mean_ci([0.7], 0.95)
    assert mean == 0.7 and math.isnan(lo) and math.isnan(hi)


@pytest.mark.parametrize("p", [0.6, 0.9, 0.975, 0.995, 0.9995])
def test_t_quantile_matches_closed_forms_for_one_and_two_degrees_of_freedom(p: float) -> None:
    assert t_quantile(p, 1) == pytest.approx(math.tan(math.pi * (p - 0.5)), rel=1e-9)
    assert t_quantile(p, 2) == pytest.approx((2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p))), rel=1e-9)


@pytest.mark.parametrize(
    ("p", "df", "table"),
    [(0.975, 1, 12.7062), (0.975, 4, 2.7764), (0.975, 10, 2.2281), (0.975, 29, 2.0452), (0.95, 5, 2.0150),
     (0.995, 30, 2.7500), (0.975, 120, 1.9799), (0.975, 1000, 1.9623), (0.975, 10**7, 1.9600)],
)  # fmt: skip
def test_t_quantile_matches_printed_tables(p: float, df: int, table: float) -> None:
    assert t_quantile(p, df) == pytest.approx(table, abs=6e-5)
    assert t_quantile(1 - p, df) == pytest.approx(-t_quantile(p, df), abs=1e-12)


def test_t_quantile_is_continuous_where_the_method_switches() -> None:
    # Exact (incomplete beta) up to 200 degrees of freedom, series beyond: no jump at the seam.
    for p in (0.9, 0.975, 0.9995):
        assert t_quantile(p, 199) > t_quantile(p, 200) > t_quantile(p, 201) > t_quantile(p, 202)
        assert t_cdf(t_quantile(p, 200), 200) == pytest.approx(p, abs=1e-12)
        assert t_cdf(t_quantile(p, 201), 201) == pytest.approx(p, abs=1e-10)
