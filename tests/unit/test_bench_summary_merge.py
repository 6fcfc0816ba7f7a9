"""`slipstream bench summary --merge`: seeds run side by side (a process each) reported as one bench.

The learned-summary plan's three seeds ran as three `bench summary --seeds N` processes on 2 cores
(session 29); the verdict across seeds (policy against masked, the spread of the differences) and
the timing plot need all of them at once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from slipstream.bench.summary import merge


def _row(seed: int, arm: str, before: float, after: float) -> dict[str, Any]:
    metrics = {"summary_at_turn_2": 0.5, "summary_at_turn_4": 0.4, "summarised": 0.9, "summary_turn": 3.0}
    return {
        "seed": seed,
        "arm": arm,
        "ok": True,
        "error": "",
        "heldout_tasks": 128,
        "wall_time_s": 10.0,
        "steps": 40,
        **{
            f"{k}_{w}": v
            for k in ("heldout_accuracy", "heldout_greedy", "train_accuracy", "train_greedy")
            for w, v in (("before", before), ("after", after))
        },
        "heldout_metrics_before": metrics,
        "heldout_metrics_after": {**metrics, "summary_turn": 2.0, "summary_at_turn_2": 0.7, "summary_at_turn_4": 0.2},
        "train_metrics_before": {},
        "train_metrics_after": {},
        "curve": [
            {"step": 1.0, "accuracy": 0.1, "policy_summaries": 1.0, "context_at_summary": 50.0, "truncations": 4.0}
        ],
    }


def _file(tmp: Path, seed: int, policy: float, masked: float, arms: list[str] | None = None) -> Path:
    path = tmp / f"s{seed}.json"
    rows = [_row(seed, "policy", 0.1, policy), _row(seed, "masked", 0.1, masked)]
    path.write_text(
        json.dumps(
            {
                "ok": True,
                "env": "recall",
                "arms": arms or ["policy", "masked"],
                "warmstarts": {str(seed): {"steps": 3800}},
                "no_rl": {str(seed): {"summary": {"heldout_accuracy": 0.01}}},
                "seeds": rows,
            }
        )
    )
    return path


def test_merged_seeds_give_one_verdict_with_the_spread_across_them(tmp_path: Path) -> None:
    files = [_file(tmp_path, 0, 0.30, 0.20), _file(tmp_path, 1, 0.25, 0.20), _file(tmp_path, 2, 0.40, 0.20)]
    out = merge(files, str(tmp_path / "merged.json"))
    c = out["verdict"]["comparisons"]["masked"]
    assert [p["seed"] for p in c["per_seed"]] == [0, 1, 2]
    assert c["mean_difference"] == pytest.approx(0.1167, abs=1e-4) and c["min_difference"] == pytest.approx(0.05)
    assert c["difference_sd_across_seeds"] == pytest.approx(0.0764, abs=1e-4)
    assert set(out["no_rl"]) == {0, 1, 2} and set(out["warmstarts"]) == {0, 1, 2}
    assert out["ok"] and out["timing"]["policy"]["after"]["summary_turn"] == 2.0
    assert out["timing_png"] is None or Path(out["timing_png"]).name == "merged-timing.png"


def test_files_of_other_arms_or_a_seed_twice_are_refused(tmp_path: Path) -> None:
    a = _file(tmp_path, 0, 0.3, 0.2)
    (tmp_path / "other").mkdir()
    other = _file(tmp_path / "other", 1, 0.3, 0.2, ["summary", "truncate"])
    with pytest.raises(SystemExit, match="ran env 'recall' arms"):
        merge([a, other], "")
    with pytest.raises(SystemExit, match="a seed appears in more than one file"):
        merge([a, a], "")
