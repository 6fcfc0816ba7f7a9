"""What the report's plots and the demo's closing lines call their figures matches what the figures are.

From a small synthetic run (a RunSummary written as summary.json, a span file), the plots are built
as matplotlib figures and read back through their artists: each line's legend label against the
numbers it draws, titles and tick labels against the figure's edges. The learner's step figures
are over the sampled batch it trained on (never "train accuracy"), held-out accuracy is drawn
sampled and greedy under those names, the stage bars say that concurrent spans each count, and the
episode row does not show a figure the run never recorded as 0. Then the demo's closing lines: the
last "held-out accuracy of vN" line printed before the summary table shows the table's version and
figure.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from rich.console import Console

from slipstream.run.follow import record_after
from slipstream.run.heldout import HeldOutScore
from slipstream.run.plan import RunSummary, TrainingPlan
from slipstream.run.progress import ProgressView, summary_table
from slipstream.run.report import (
    BATCH_ACCURACY,
    BATCH_REWARD,
    HELDOUT_GREEDY,
    HELDOUT_SAMPLED,
    STAGE_BUSY,
    STAGE_SUM,
    build_report,
    load_run,
    reward_plot,
    stages_plot,
)
from slipstream.run.report_figure import figure
from slipstream.telemetry.trace_stats import time_by_stage

pytestmark = pytest.mark.unit

N = 6
T0_NS = 1_800_000_000 * 10**9


def steps_log(*, samples: bool = True) -> list[dict[str, Any]]:
    return [
        {
            "step": i,
            "version": i,
            "reward": 0.5 + 0.01 * i,
            "accuracy": 0.4 + 0.02 * i,
            "trajectories": 32,
            "staleness": {"0": 32},
            "t": 1.0 * i,
            "turns_per_episode": 1.0,
            "tool_calls_per_turn": 0.0,
            "invalid_call_rate": 0.0,
            **({"samples_per_episode": 1.0} if samples else {}),
        }
        for i in range(1, N + 1)
    ]


def span(sid: str, name: str, start_s: float, dur_s: float) -> dict[str, Any]:
    start = T0_NS + int(start_s * 1e9)
    return {
        "trace_id": "f" * 32, "span_id": sid, "parent_span_id": None, "name": name, "kind": "consumer",
        "service": "rollout-worker", "start_ns": start, "end_ns": start + int(dur_s * 1e9), "status": "unset",
        "attributes": {}, "links": [], "events": [],
    }  # fmt: skip


def write_run(tmp: Path, *, samples: bool = True) -> Path:
    run = tmp / "run-labels"
    (run / "logs").mkdir(parents=True)
    summary = RunSummary(
        ok=True,
        plan=TrainingPlan(max_steps=N, temperature=1.0, heldout_samples=4),
        heldout_tasks=64,
        heldout_accuracy_before=0.2,
        heldout_greedy_before=0.3,
        heldout_accuracy_after=0.45,
        heldout_greedy_after=0.6,
        steps=N,
        final_version=N,
        versions_published=N,
        eval_curve=[
            {"version": 0.0, "accuracy": 0.2, "greedy": 0.3},
            {"version": 3.0, "accuracy": 0.35, "greedy": 0.5},
            {"version": float(N), "accuracy": 0.45, "greedy": 0.6},
        ],
        steps_log=steps_log(samples=samples),
    )
    (run / "summary.json").write_bytes(msgspec.json.encode(summary))
    # Eight messages handled at once for 2 s, then one more for 1 s: 17 s summed, 3 s of wall time.
    spans = [span(f"{k:016x}", "process tasks.reverse", 0.0, 2.0) for k in range(8)]
    spans.append(span("a" * 16, "process tasks.reverse", 2.0, 1.0))
    spans.append(span("b" * 16, "a stage whose name is long enough that a narrow figure would cut it off", 3.0, 0.5))
    (run / "traces.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
    return run


def lines_by_label(fig: Any) -> dict[str, tuple[list[float], list[float]]]:
    (ax,) = fig.axes
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    drawn = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()}
    assert sorted(legend) == sorted(drawn), (legend, list(drawn))
    return drawn


def inside(fig: Any, artist: Any) -> bool:
    box = artist.get_window_extent()  # measured by the figure's own renderer, at the dpi it is saved at
    edge = fig.bbox
    return box.x0 >= edge.x0 - 1 and box.x1 <= edge.x1 + 1 and box.y0 >= edge.y0 - 1 and box.y1 <= edge.y1 + 1


def test_the_reward_plot_names_batch_sampled_and_greedy_figures_for_what_they_are(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    run = load_run(write_run(tmp_path), [])
    plot = reward_plot(run)
    fig = figure(plot)
    try:
        drawn = lines_by_label(fig)
    finally:
        plt.close(fig)
    assert set(drawn) == {BATCH_REWARD, BATCH_ACCURACY, HELDOUT_SAMPLED, HELDOUT_GREEDY}
    assert not any("train accuracy" in label for label in drawn)
    steps = [float(i) for i in range(1, N + 1)]
    # The learner's batch figures: exactly the steps' reward and accuracy.
    assert drawn[BATCH_ACCURACY] == (steps, pytest.approx([0.4 + 0.02 * i for i in range(1, N + 1)]))
    assert drawn[BATCH_REWARD][1] == pytest.approx([0.5 + 0.01 * i for i in range(1, N + 1)])
    # Held-out: the "sampled" line draws the summary's sampled figures (RunSummary.heldout_accuracy_*,
    # eval_curve "accuracy"), the "greedy" line its greedy ones; before RL at step 0.
    assert drawn[HELDOUT_SAMPLED] == ([0.0, 3.0, float(N)], [0.2, 0.35, 0.45])
    assert drawn[HELDOUT_GREEDY] == ([0.0, 3.0, float(N)], [0.3, 0.5, 0.6])
    assert "sampled" in BATCH_ACCURACY and "batch" in BATCH_ACCURACY and "batch" in BATCH_REWARD
    # The caption says how held-out was sampled, from the plan, and no longer calls it greedy alone.
    assert "sampled (T=1, 4 samples per task) and greedy" in plot.caption
    assert "(greedy," not in plot.caption and "training accuracy" not in plot.caption


def test_the_stage_plot_shows_sums_beside_wall_time_and_cuts_no_label(tmp_path: Path) -> None:
    import matplotlib.pyplot as plt

    run = load_run(write_run(tmp_path), [tmp_path / "run-labels" / "traces.jsonl"])
    plot = stages_plot(run)
    (panel,) = plot.panels
    assert panel.labels[0] == "rollout-worker: process tasks.reverse (x9)"
    assert panel.series[STAGE_SUM]["y"] == pytest.approx([17.0, 0.5])
    assert panel.series[STAGE_BUSY]["y"] == pytest.approx([3.0, 0.5])
    assert "concurrent spans each count" in STAGE_SUM and "can exceed the run's wall time" in plot.caption
    fig = figure(plot)
    try:
        (ax,) = fig.axes
        fig.canvas.draw()
        assert [t.get_text() for t in ax.get_legend().get_texts()] == [STAGE_SUM, STAGE_BUSY]
        # Bars drawn are the series: two per stage, the sum's and the wall time's.
        widths = sorted(round(p.get_width(), 6) for p in ax.patches)
        assert widths == sorted([17.0, 0.5, 3.0, 0.5])
        title = ax.title
        assert title.get_text().replace("\n", " ") == f"{plot.title}: {panel.title}"
        assert inside(fig, title), "the title runs off the figure"
        ticks = [t for t in ax.get_yticklabels() if t.get_text()]
        assert [t.get_text() for t in ticks] == panel.labels
        assert all(inside(fig, t) for t in ticks), "a stage name runs off the figure"
    finally:
        plt.close(fig)


def test_the_covered_seconds_count_overlaps_once() -> None:
    spans = [span("1" * 16, "s", 0.0, 2.0), span("2" * 16, "s", 1.0, 2.0), span("3" * 16, "s", 5.0, 1.0)]
    (stage,) = time_by_stage(spans)
    assert (stage.count, stage.total_s, stage.busy_s) == (3, pytest.approx(5.0), pytest.approx(4.0))


def test_the_page_shows_samples_per_episode_as_recorded_and_never_an_unrecorded_zero(tmp_path: Path) -> None:
    page = tmp_path / "a"
    build_report(write_run(tmp_path / "with"), page)
    text = (page / "index.html").read_text()
    assert "samples per episode 1.000 / 1.000" in text
    assert "held-out accuracy before (v0) / after (v6), sampled" in text and "0.200 / 0.450" in text
    assert "T=1, 4 samples per task" in text
    assert "held-out accuracy before (v0) / after (v6), greedy" in text and "0.300 / 0.600" in text
    older = tmp_path / "b"  # a summary written before the follower recorded samples_per_episode
    build_report(write_run(tmp_path / "without", samples=False), older)
    text = (older / "index.html").read_text()
    assert "samples per episode" not in text and "turns per episode 1.000 / 1.000" in text


def closing(plan: TrainingPlan, summary: RunSummary, events: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """What the demo prints: the view's event lines, then the summary table (demo.execute's order)."""
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    view = ProgressView(console, plan, live=False)
    for kind, data in events:
        view.on_event(kind, data)
    console.print(summary_table(summary))
    return out.getvalue().splitlines()


def last_eval_line(lines: list[str]) -> tuple[int, float, float]:
    hits = [m for line in lines if (m := re.match(r"held-out accuracy of v(\d+): ([0-9.]+) sampled, ([0-9.]+)", line))]
    assert hits, lines
    return int(hits[-1][1]), float(hits[-1][2]), float(hits[-1][3])


def table_after(lines: list[str]) -> tuple[int, float, float]:
    (header,) = [line for line in lines if "held-out after" in line]
    version = int(re.search(r"held-out after \(v(\d+)\)", header)[1])  # type: ignore[index]
    cells = {
        name: [c.strip() for c in re.split("[│┃]", line) if c.strip()]
        for line in lines
        for name in ("sampled", "greedy")
        if re.match(rf"^[│┃]\s*{name}\s", line)
    }
    return version, float(cells["sampled"][-1]), float(cells["greedy"][-1])


@pytest.mark.parametrize("final", [60, 57])
def test_the_closing_eval_line_shows_the_tables_version_and_figure(final: int) -> None:
    """A periodic eval scored v57 (0.232); the run ended at `final`. 60: a new evaluation, its line
    printed last; 57: the periodic score is reused (not sampled again) and its line printed last."""
    plan = TrainingPlan(max_steps=60, eval_every=19, train_eval_tasks=0)
    summary = RunSummary(ok=True, plan=plan, heldout_tasks=64, final_version=final)
    periodic = HeldOutScore(accuracy=0.232, reward=0.232, greedy=0.3)
    events: list[tuple[str, dict[str, Any]]] = [
        ("eval", HeldOutScore(0.1, 0.1, 0.2).row(0)),
        ("eval", periodic.row(57)),
    ]
    summary.eval_curve = [events[0][1], events[1][1]]
    events.append(("log", {"message": "stopping rollout-worker"}))
    after = periodic if final == 57 else HeldOutScore(accuracy=0.251, reward=0.251, greedy=0.31)
    record_after(summary, after, lambda kind, data: events.append((kind, data)), new=final != 57)
    lines = closing(plan, summary, events)
    assert last_eval_line(lines) == table_after(lines) == (final, after.accuracy, after.greedy)
    assert summary.heldout_accuracy_after == after.accuracy
    # One row per version in the eval curve (the report plots it): 57 is not recorded twice.
    assert [int(r["version"]) for r in summary.eval_curve] == sorted({0, 57, final})
