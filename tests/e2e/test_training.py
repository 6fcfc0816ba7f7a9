"""The loop that learns: the five-process pipeline on real NATS trains the tiny model.

One run of `run_training` (what `slipstream demo` runs) with a shrunk plan, shared with
test_traces (tests/e2e/conftest.py): warm-start, then
rollout-worker, reward-model, learner, weight-publisher and task-source as separate processes
against a real nats-server and Redis. Asserted:

- held-out accuracy (sampled at the rollout temperature, 256 tasks x 4 samples) rises by at
  least MARGIN, and greedy held-out accuracy rises too. The full 60-step demo rose +0.11 to
  +0.26 sampled and +0.08 to +0.31 greedy over seeds 0-4 (before ~0.09 / ~0.18); the standard
  error of a sampled estimate is ~0.01, so 0.05 is well clear of noise while leaving room for
  the shorter run and slower machines; train-split accuracy is measured alike (the summary's
  side-by-side table);
- every trajectory published is accounted for: scored, dead-lettered or left in the raw stream;
  every scored one trained, dropped with a reason, or left in the learner's stream;
- some rollout spanned a weight update and carries two versions in its segments;
- `slipstream report` on the run writes the HTML page and the PNGs; the reward and staleness
  plots have a data point for every step, time-to-policy one for every version a worker applied.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shared_run import DemoRun

from slipstream.cli.report import build_report

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MARGIN = 0.05


@pytest.mark.timeout(900)
def test_pipeline_learns_and_accounts_for_every_trajectory(demo_run: DemoRun, tmp_path: Path) -> None:
    plan, summary = demo_run.plan, demo_run.summary

    assert summary.steps == plan.max_steps
    assert summary.versions_published == plan.max_steps + 1  # version 0 (initial weights) + one per step
    rise = summary.heldout_accuracy_after - summary.heldout_accuracy_before
    assert rise >= MARGIN, (
        f"held-out accuracy {summary.heldout_accuracy_before:.3f} -> {summary.heldout_accuracy_after:.3f}"
    )
    greedy = (summary.heldout_greedy_before, summary.heldout_greedy_after)
    assert greedy[1] > greedy[0], f"held-out greedy accuracy {greedy[0]:.3f} -> {greedy[1]:.3f}"
    assert 0 <= summary.train_accuracy_before < summary.train_accuracy_after
    assert summary.warmstart["reached"], summary.warmstart

    tr = summary.trajectories
    assert tr["published"] > 0
    assert tr["accounted_raw"], tr
    assert tr["accounted_scored"], tr
    assert tr["trained"] == plan.max_steps * plan.groups_per_step * plan.group_size
    assert set(tr["dropped"]) <= {"stale", "uniform_group", "incomplete_group", "duplicate", "malformed"}, tr

    assert summary.spanning_versions >= 1

    out = tmp_path / "report"
    report = build_report(demo_run.run_dir, out)
    assert (out / "index.html").exists()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert {"reward.png", "staleness.png", "time_to_policy.png"} <= set(pngs), pngs
    steps = [float(i) for i in range(1, plan.max_steps + 1)]
    panels = report["plots"]
    assert dict(panels["reward"]["panels"][0]["series"])["reward (mean per step)"]["x"] == steps
    assert dict(panels["staleness"]["panels"][1]["series"])["mean staleness"]["x"] == steps
    # A worker that is busy skips versions overtaken by newer ones: time-to-policy has a point per applied version.
    applied = dict(panels["time_to_policy"]["panels"][0]["series"])["step -> first worker applied"]["x"]
    assert applied and set(applied) <= set(steps)
