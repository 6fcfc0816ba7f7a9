"""`slipstream bench summary`'s verdict: summary minus truncate after RL, per seed and across seeds."""

from __future__ import annotations

import math

import pytest

from slipstream.bench.summary import verdict

pytestmark = pytest.mark.unit


def _row(seed: int, arm: str, before: float, after: float, ok: bool = True) -> dict:
    return {"seed": seed, "arm": arm, "ok": ok, "heldout_tasks": 64, "heldout_accuracy_before": before,
            "heldout_accuracy_after": after}  # fmt: skip


def test_the_difference_is_judged_per_seed_against_its_standard_error() -> None:
    rows = [_row(0, "summary", 0.3, 0.8), _row(0, "truncate", 0.3, 0.35), _row(1, "summary", 0.2, 0.6)]
    rows.append(_row(1, "truncate", 0.2, 0.3))
    v = verdict(rows)
    first = v["per_seed"][0]
    assert first["difference"] == pytest.approx(0.45)
    assert first["se"] == pytest.approx(round(math.sqrt((0.8 * 0.2 + 0.35 * 0.65) / 64), 4))
    assert first["summary_rl_change"] == pytest.approx(0.5) and first["truncate_rl_change"] == pytest.approx(0.05)
    assert v["summary_beats_truncate_every_seed"] and v["min_difference"] == pytest.approx(0.3)
    assert v["runs_ok"] and v["t_across_seeds"] is not None


def test_a_seed_where_truncation_wins_or_an_arm_failed_is_not_hidden() -> None:
    rows = [_row(0, "summary", 0.1, 0.2), _row(0, "truncate", 0.1, 0.3)]
    rows += [_row(1, "summary", 0.1, 0.5), _row(1, "truncate", 0.1, 0.0, ok=False)]
    v = verdict(rows)
    assert not v["runs_ok"] and not v["summary_beats_truncate_every_seed"]
    assert [p["seed"] for p in v["per_seed"]] == [0]  # a seed missing an arm is not compared


def test_the_first_arm_is_compared_with_every_other_arm() -> None:
    rows = []
    for seed, (p, m, t) in enumerate(((0.9, 0.5, 0.0), (0.8, 0.6, 0.0), (0.85, 0.4, 0.0))):
        rows += [_row(seed, "policy", 0.2, p), _row(seed, "masked", 0.2, m), _row(seed, "truncate", 0.0, t)]
    v = verdict(rows, ("policy", "masked", "truncate"))
    assert set(v["comparisons"]) == {"masked", "truncate"} and v["lead"] == "policy"
    masked = v["comparisons"]["masked"]
    assert [p["difference"] for p in masked["per_seed"]] == pytest.approx([0.4, 0.2, 0.45])
    assert masked["beats_every_seed"] and masked["min_difference"] == pytest.approx(0.2)
    assert masked["per_seed"][0]["policy_rl_change"] == pytest.approx(0.7)
    assert v["policy_beats_masked_every_seed"] and v["t_across_seeds"] == masked["t_across_seeds"]
    assert masked["p_sign_flip"] == v["p_sign_flip"] == 1 / 8  # three seeds, all ahead: the least p there is


def test_timing_averages_when_the_first_summary_opened_over_seeds() -> None:
    from slipstream.bench.summary import timing

    def metrics(turns: dict[int, float], mean: float, threshold: float | None = None) -> dict:
        out = {f"summary_at_turn_{k}": v for k, v in turns.items()}
        out.update(summarised=sum(turns.values()), summary_turn=mean, kept_asked=0.5, kept_value=0.25 + mean / 10)
        if threshold is not None:
            out["threshold_turn"] = threshold
        return out

    rows = []
    for seed, late in enumerate((0.6, 0.4)):
        row = _row(seed, "policy", 0.2, 0.8)
        row["heldout_metrics_before"] = metrics({0: 0.5, 5: 0.5}, 2.5)
        row["heldout_metrics_after"] = metrics({0: 1 - late, 5: late}, 5 * late)
        rows.append(row)
        trunc = _row(seed, "truncate", 0.0, 0.0)
        trunc["heldout_metrics_before"] = trunc["heldout_metrics_after"] = {"threshold_turn": 6.0 + seed}
        rows.append(trunc)
    t = timing(rows)
    assert set(t) == {"policy", "fixed_threshold_turn"}  # the truncate arm never summarised
    assert t["policy"]["after"]["turns"] == [0, 5] and t["policy"]["after"]["share"] == pytest.approx([0.5, 0.5])
    assert t["policy"]["before"]["summary_turn"] == 2.5 and t["fixed_threshold_turn"] == pytest.approx(6.5)
    assert t["policy"]["after"]["kept_value"] == pytest.approx(0.5) and t["policy"]["before"]["kept_asked"] == 0.5


def test_the_training_curve_is_the_context_size_where_summaries_opened_and_the_plot_draws(tmp_path) -> None:
    from slipstream.bench.summary import curves, plot_timing, step_point, timing

    point = step_point(
        {"step": 3, "accuracy": 0.2, "episode_means": {"policy_summaries": 0.5, "summary_context_tokens": 20.0}}
    )
    assert point["context_at_summary"] == 40.0  # a per-episode sum over half the episodes: 40 tokens a summary
    assert step_point({"step": 4})["context_at_summary"] == 0.0  # no summary in the batch: not a size of 0
    rows = []
    for seed, size in enumerate((40.0, 30.0)):
        row = _row(seed, "policy", 0.1, 0.3)
        row["curve"] = [{"step": 1.0, "policy_summaries": 1.0, "context_at_summary": size, "accuracy": 0.1}]
        row["curve"].append({"step": 2.0, "policy_summaries": 0.0, "context_at_summary": 0.0, "accuracy": 0.1})
        row["heldout_metrics_before"] = {"summary_at_turn_2": 1.0, "summarised": 1.0, "summary_turn": 2.0}
        row["heldout_metrics_after"] = {"summary_at_turn_1": 1.0, "summarised": 1.0, "summary_turn": 1.0}
        rows.append(row)
    assert curves(rows) == {"policy": [(1.0, 35.0)]}
    png = plot_timing(timing(rows), tmp_path / "t.png", "test", curves(rows))
    assert png is not None and png.stat().st_size > 1000
