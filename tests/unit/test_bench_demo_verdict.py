"""`slipstream bench demo`'s verdict over per-seed rows: rises, the invalid-call rate's fall, the noise."""

from __future__ import annotations

import math

import pytest

from slipstream.bench.demo import verdict

pytestmark = pytest.mark.unit


def _row(seed: int, before: float, after: float, invalid: tuple[float, float]) -> dict[str, object]:
    row: dict[str, object] = {"seed": seed, "ok": True, "wall_time_s": 100.0 + seed, "heldout_tasks": 128}
    for field in ("train_accuracy", "heldout_accuracy", "heldout_greedy", "train_greedy"):
        row[f"{field}_before"], row[f"{field}_after"] = before, after
    row["heldout_invalid_call_rate_before"], row["heldout_invalid_call_rate_after"] = invalid
    row["heldout_tool_calls_before"], row["heldout_tool_calls_after"] = 0.9, 1.0
    return row


def test_the_verdict_of_a_tool_env_judges_rises_falls_and_noise() -> None:
    rows = [_row(0, 0.05, 0.07, (0.33, 0.06)), _row(1, 0.4, 0.9, (0.24, 0.02)), _row(2, 0.09, 0.19, (0.30, 0.05))]
    v = verdict(rows)
    assert v["heldout_sampled_rose_every_seed"] and v["heldout_invalid_call_rate_fell_every_seed"]
    assert v["min_change"]["heldout_accuracy"] == pytest.approx(0.02)
    # The least improvement of a falling rate is its smallest fall, not its largest.
    assert v["min_change"]["heldout_invalid_call_rate"] == pytest.approx(-0.22)
    assert v["median_change"]["heldout_invalid_call_rate"] == pytest.approx(-0.25)
    assert v["heldout_change_se_max"] == pytest.approx(round(math.sqrt((0.4 * 0.6 + 0.9 * 0.1) / 128), 4))
    assert v["heldout_before_spread"] == pytest.approx(0.35)
    rows[2]["heldout_invalid_call_rate_after"] = 0.31
    assert not verdict(rows)["heldout_invalid_call_rate_fell_every_seed"]
