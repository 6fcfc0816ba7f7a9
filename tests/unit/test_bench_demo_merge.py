"""`slipstream bench demo --merge`: seeds run as separate `slipstream demo --summary-json` processes,
reported as one bench, with each env figure's change judged against the seeds' spread."""

from __future__ import annotations

import math
from pathlib import Path

import msgspec
import pytest

from slipstream.bench.demo import merge, metric_margins
from slipstream.run.presets import demo_plan
from slipstream.run.training import RunSummary

pytestmark = pytest.mark.unit


def _summary(env: str, seed: int, found: tuple[float, float], prune: tuple[float, float]) -> RunSummary:
    plan = demo_plan(env)
    plan.seed = seed
    before = {"final_answer_found": found[0], "prune_share": prune[0], "episodes": 800.0}
    after = {"final_answer_found": found[1], "prune_share": prune[1], "episodes": 800.0}
    return RunSummary(
        ok=True,
        plan=plan,
        heldout_tasks=200,
        heldout_accuracy_before=found[0],
        heldout_accuracy_after=found[1],
        heldout_metrics_before=before,
        heldout_metrics_after=after,
        train_metrics_before={**before, "final_answer_found": found[0] + 0.2},
        train_metrics_after={**after, "final_answer_found": found[1] + 0.2},
        wall_time_s=1000.0 + seed,
    )


def _write(tmp_path: Path, summary: RunSummary) -> Path:
    p = tmp_path / f"{summary.plan.env}-s{summary.plan.seed}.json"
    p.write_bytes(msgspec.json.encode(summary))
    return p


def test_merged_seeds_report_each_figure_with_its_spread(tmp_path: Path) -> None:
    runs = [
        _summary("search", 0, (0.02, 0.10), (0.05, 0.30)),
        _summary("search", 1, (0.03, 0.07), (0.08, 0.20)),
        _summary("search", 2, (0.01, 0.13), (0.06, 0.50)),
    ]
    result = merge([_write(tmp_path, r) for r in runs])
    assert result["ok"] and [r["seed"] for r in result["seeds"]] == [0, 1, 2]
    assert len(result["merged"]) == 3 and result["load_average_1m"] == []
    held = result["verdict"]["metric_margins"]["heldout"]
    changes = [0.08, 0.04, 0.12]
    found = held["final_answer_found"]
    assert found["change_mean"] == pytest.approx(0.08)
    sd = math.sqrt(sum((c - 0.08) ** 2 for c in changes) / 2)
    assert found["change_sd"] == pytest.approx(sd, abs=1e-4)
    assert found["t"] == pytest.approx(0.08 / (sd / math.sqrt(3)), abs=0.01)
    assert held["prune_share"]["before_mean"] == pytest.approx(0.0633, abs=1e-4)
    assert "episodes" not in held  # a count, not a figure
    train = result["verdict"]["metric_margins"]["train"]
    assert train["final_answer_found"]["before_mean"] == pytest.approx(0.22)


def test_one_seed_has_no_spread_to_judge_by() -> None:
    rows = [
        {"heldout_metrics_before": {"f1": 0.1}, "heldout_metrics_after": {"f1": 0.3}},
    ]
    m = metric_margins(rows)["f1"]
    assert m["change_mean"] == pytest.approx(0.2) and m["change_sd"] is None and m["t"] is None


def test_merge_refuses_mixed_envs_repeated_seeds_and_files_that_are_not_summaries(tmp_path: Path) -> None:
    a = _write(tmp_path, _summary("search", 0, (0.0, 0.1), (0.0, 0.1)))
    b = _write(tmp_path, _summary("code", 1, (0.0, 0.1), (0.0, 0.1)))
    with pytest.raises(SystemExit, match="ran env 'code'"):
        merge([a, b])
    with pytest.raises(SystemExit, match="more than one file"):
        merge([a, a])
    bad = tmp_path / "bad.json"
    bad.write_text('{"ok": "yes"}')
    with pytest.raises(SystemExit, match=r"bad\.json is not a `slipstream demo --summary-json` file"):
        merge([a, bad])
    with pytest.raises(SystemExit, match="no such file"):
        merge([tmp_path / "missing.json"])
