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
