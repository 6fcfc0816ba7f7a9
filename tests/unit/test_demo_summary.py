"""The demo's closing summary puts train-split and held-out accuracy side by side.

Rendered with rich into text and read back: one row per decoding (sampled, greedy), columns
train before / after and held-out before / after, so a memorising policy (train up, held-out
flat) is visible at a glance. Unmeasured train figures (-1) show as "-".
"""

from __future__ import annotations

import re

import pytest
from rich.console import Console

from slipstream.run.presets import demo_plan
from slipstream.run.progress import summary_table
from slipstream.run.training import RunSummary

pytestmark = pytest.mark.unit


def render(summary: RunSummary) -> list[str]:
    console = Console(record=True, width=140, color_system=None)
    console.print(summary_table(summary))
    return console.export_text().splitlines()


def row(lines: list[str], label: str) -> list[str]:
    hits = [line for line in lines if label in line]
    assert len(hits) == 1, (label, lines)
    return [cell.strip() for cell in re.split("[│┃]", hits[0]) if cell.strip()]


def test_train_and_heldout_sit_side_by_side_before_and_after() -> None:
    plan = demo_plan()
    s = RunSummary(
        ok=True,
        plan=plan,
        heldout_tasks=plan.heldout_tasks,
        train_accuracy_before=0.111,
        train_accuracy_after=0.222,
        heldout_accuracy_before=0.333,
        heldout_accuracy_after=0.444,
        train_greedy_before=0.555,
        train_greedy_after=0.666,
        heldout_greedy_before=0.777,
        heldout_greedy_after=0.888,
    )
    lines = render(s)
    header = row(lines, "train before")
    assert header == [
        "decoding",
        "train before (v0)",
        "train after (v0)",
        "held-out before (v0)",
        "held-out after (v0)",
    ]
    assert row(lines, "│ sampled")[1:] == ["0.111", "0.222", "0.333", "0.444"]
    assert row(lines, "greedy")[1:] == ["0.555", "0.666", "0.777", "0.888"]
    caption = f"{plan.train_eval_tasks} train-split and {plan.heldout_tasks} held-out tasks; sampled: 4 per task"
    assert any(caption in x for x in lines)
    # reverse calls no tools: no invalid-call row
    assert not any("invalid tool calls" in x for x in lines)


def test_unmeasured_train_split_shows_a_dash() -> None:
    plan = demo_plan()
    plan.train_eval_tasks = 0
    s = RunSummary(ok=True, plan=plan, heldout_accuracy_before=0.25, heldout_greedy_after=0.5)
    lines = render(s)
    assert row(lines, "│ sampled")[1:] == ["-", "-", "0.250", "0.000"]
    assert row(lines, "greedy")[1:] == ["-", "-", "0.000", "0.500"]


def test_the_reverse_demo_measures_train_like_heldout_and_lookup_keeps_its_own() -> None:
    plan = demo_plan()
    assert plan.train_eval_tasks == plan.heldout_tasks > 0
    lookup = demo_plan("lookup")
    assert lookup.train_eval_tasks == 128
    lines = render(RunSummary(ok=True, plan=lookup))
    assert any("invalid tool calls" in x for x in lines)


def test_a_tool_env_shows_invalid_calls_beside_success_and_calls_per_episode() -> None:
    plan = demo_plan("lookup")
    s = RunSummary(
        ok=True,
        plan=plan,
        heldout_accuracy_before=0.5,
        heldout_accuracy_after=0.8,
        heldout_invalid_call_rate_before=0.35,
        heldout_invalid_call_rate_after=0.05,
        train_invalid_call_rate_before=0.3,
        train_invalid_call_rate_after=0.04,
        heldout_tool_calls_before=1.1,
        heldout_tool_calls_after=0.95,
    )
    lines = render(s)
    assert row(lines, "│ sampled")[1:] == ["-", "-", "0.500", "0.800"]
    assert row(lines, "invalid tool calls per call")[1:] == ["0.300", "0.040", "0.350", "0.050"]
    assert row(lines, "tool calls per episode")[1:] == ["1.10 / 0.95"]
    # Not measured on the train split: a dash, not a rate of -1.
    s.train_invalid_call_rate_before = s.train_invalid_call_rate_after = -1.0
    assert row(render(s), "invalid tool calls per call")[1:3] == ["-", "-"]


def test_the_search_demo_shows_contexts_table_train_beside_heldout() -> None:
    plan = demo_plan("search")
    assert plan.loss == "cispo" and plan.env_options["backend"] == "bm25"
    before = {"final_answer_found": 0.1, "output_recall": 0.2, "traj_recall": 0.5, "f1": 0.15, "episodes": 192.0}
    after = {**before, "final_answer_found": 0.4, "prune_accuracy": 1.0}
    summary = RunSummary(
        ok=True,
        plan=plan,
        heldout_metrics_before=before,
        heldout_metrics_after=after,
        train_metrics_before={**before, "final_answer_found": 0.3},
        train_metrics_after={**before, "final_answer_found": 0.6},
    )
    lines = render(summary)
    assert row(lines, "final-answer-found") == ["final-answer-found", "0.300", "0.600", "0.100", "0.400"]
    assert row(lines, "prune accuracy") == ["prune accuracy", "-", "-", "-", "1.000"]
    assert row(lines, "trajectory recall")[1:] == ["0.500"] * 4
    assert not any(line.strip().startswith("│ episodes") for line in lines)  # a count, not a figure


def test_the_search_demo_names_the_prune_share_and_the_median_turns() -> None:
    """Issue 33 reads the share of episodes that prune (from <= 0.1) and the median turns (> 2)."""
    before = {"final_answer_found": 0.1, "prune_share": 0.07, "turns_median": 3.0, "turns_per_episode": 3.3}
    after = {**before, "prune_share": 0.4, "turns_median": 5.0}
    summary = RunSummary(
        ok=True,
        plan=demo_plan("search"),
        heldout_metrics_before=before,
        heldout_metrics_after=after,
        train_metrics_before=before,
        train_metrics_after=after,
    )
    lines = render(summary)
    assert row(lines, "episodes that prune") == ["episodes that prune", "0.070", "0.400", "0.070", "0.400"]
    assert row(lines, "turns per episode (median)")[1:] == ["3.000", "5.000", "3.000", "5.000"]
    assert not any("prune_share" in line or "turns_median" in line for line in lines)  # named, not raw keys
