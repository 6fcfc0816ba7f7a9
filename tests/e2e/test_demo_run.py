"""The loop that learns, and one trace per task across every service.

One run of `run_training` (what `slipstream demo` runs) with a shrunk plan, shared by the two
tests of this file (conftest.demo_run; one file, so `--dist loadfile` gives both to one xdist
worker and the run happens once): warm-start, then rollout-worker, reward-model, learner,
weight-publisher and task-source as separate processes against a real nats-server and Redis.

The training test asserts:

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

The trace test: the run writes its spans (`traces=True`: every service to
run_dir/traces.<service>.jsonl); they are read back, and one task that was trained on is
followed through them, checking each span's service and its parent or link:

    task.publish (task-source, root) -> ... -> process tasks.* (rollout-worker)
      -> rollout.generate (rollout-worker) -> ... -> process traj.raw.* (reward-model)
      -> publish traj.scored.* (reward-model)  <-- linked from learner.step (learner, a new trace)
    learner.step -> weights.publish (weight-publisher, child) -> ... -> weights.apply (rollout-worker)

"->" is a direct parent; "-> ... ->" an ancestor, since the bus adds its own publish span
between a service's span and the consumer's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from shared_run import DemoRun
from spans import Span, Spans, trained_groups, trained_ids

from slipstream.run.report import BATCH_REWARD, build_report
from slipstream.run.training import PIPELINE
from slipstream.telemetry.spanfile import read_spans

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
    # Every step trained groups_per_step groups, each whole or less members dropped on their own
    # (once, seed 0: half a group gone stale while its other half arrived, 2,876 of 2,880 trained).
    groups, trained, odd = trained_groups(demo_run.run_dir, plan.group_size)
    assert groups == plan.max_steps * plan.groups_per_step and odd == {}, odd
    assert tr["trained"] == trained <= plan.max_steps * plan.groups_per_step * plan.group_size
    assert set(tr["dropped"]) <= {"stale", "uniform_group", "incomplete_group", "duplicate", "malformed"}, tr
    # The demo screens tasks before sampling them (rollout-worker screen.py): the workers judged
    # every task, skipped some, and no rollouts were spent on those.
    if plan.screen_target > 0:
        screen = tr["screen"]
        assert screen["screened"] > 0 and screen["kept"] > 0 and screen["not_judged"] == 0, screen

    assert summary.spanning_versions >= 1

    out = tmp_path / "report"
    report = build_report(demo_run.run_dir, out)
    assert (out / "index.html").exists()
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert {"reward.png", "staleness.png", "time_to_policy.png"} <= set(pngs), pngs
    steps = [float(i) for i in range(1, plan.max_steps + 1)]
    panels = report["plots"]
    assert dict(panels["reward"]["panels"][0]["series"])[BATCH_REWARD]["x"] == steps
    assert dict(panels["staleness"]["panels"][1]["series"])["mean staleness"]["x"] == steps
    # A worker that is busy skips versions overtaken by newer ones: time-to-policy has a point per applied version.
    applied = dict(panels["time_to_policy"]["panels"][0]["series"])["step -> first worker applied"]["x"]
    assert applied and set(applied) <= set(steps)


# The shared run (conftest.demo_run) may start in this test: its timeout covers the whole run.
@pytest.mark.timeout(900)
def test_one_trace_follows_a_task_from_the_source_to_a_workers_weight_application(demo_run: DemoRun) -> None:
    plan, run_dir = demo_run.plan, demo_run.run_dir
    assert demo_run.summary.steps == plan.max_steps

    files = [run_dir / f"traces.{name}.jsonl" for name in PIPELINE]
    records, bad = read_spans(files)
    assert bad == 0
    spans = Spans(records)
    trained = trained_ids(run_dir)
    groups, n, odd = trained_groups(run_dir, plan.group_size)
    assert groups == plan.max_steps * plan.groups_per_step and odd == {} and len(trained) == n, odd

    # Every span names its service, and every service wrote some.
    assert {s["service"] for s in spans.all} == set(PIPELINE)

    # --- the task's trace: task-source -> rollout-worker -> reward-model --------------------------
    generated = {s["attributes"]["slipstream.trajectory_id"]: s for s in spans.by_name["rollout.generate"]}
    assert set(trained) <= set(generated), "a trained trajectory has no rollout.generate span"
    # trajectory id -> the reward model's publishes of its scored copy (more than one if redelivered)
    scored_publish: dict[str, list[Span]] = {}
    for tid in trained:
        gen = generated[tid]
        assert gen["service"] == "rollout-worker"
        assert gen["attributes"]["slipstream.policy_versions"], gen
        assert tid.startswith(gen["attributes"]["slipstream.task_id"] + "/")

        worker = spans.by_id[gen["parent_span_id"]]
        assert (worker["service"], worker["kind"]) == ("rollout-worker", "consumer")
        assert worker["name"].startswith("process tasks.")
        assert worker["attributes"]["slipstream.task_id"] == gen["attributes"]["slipstream.task_id"]
        assert worker["attributes"]["slipstream.worker_id"] == gen["attributes"]["slipstream.worker_id"]

        root = spans.nearest(worker, "task.publish")
        assert root is not None, f"no task.publish above the worker's span of {tid}"
        assert (root["service"], root["kind"], root["parent_span_id"]) == ("task-source", "producer", None)
        assert root["attributes"]["slipstream.task_id"] == worker["attributes"]["slipstream.task_id"]

        rewards = [c for c in spans.children[gen["span_id"]] if c["name"].startswith("publish traj.raw.")]
        assert len(rewards) == 1, f"{tid}: {len(rewards)} trajectory publishes under its rollout.generate"
        consumed = spans.descendants(gen, f"process traj.raw.{plan.env}")
        assert consumed, f"no reward-model span under the rollout.generate of {tid}"
        scored_publish[tid] = []
        for c in consumed:
            assert c["service"] == "reward-model"
            assert c["attributes"]["slipstream.trajectory_id"] == tid
            assert "slipstream.reward" in c["attributes"]
            scored_publish[tid] += [
                s for s in spans.children[c["span_id"]] if s["name"].startswith("publish traj.scored.")
            ]
        assert scored_publish[tid], f"the reward model published no scored copy of {tid} in its trace"
        for s in (gen, worker, *consumed, *scored_publish[tid]):
            assert s["trace_id"] == root["trace_id"]

    # --- the learner step links every trajectory it trained on ------------------------------------
    steps = {s["attributes"]["slipstream.step"]: s for s in spans.by_name["learner.step"]}
    assert set(range(1, plan.max_steps + 1)) <= set(steps)
    for tid, step_no in trained.items():
        step = steps[step_no]
        assert (step["service"], step["parent_span_id"]) == ("learner", None)
        linked = {(link["trace_id"], link["span_id"]) for link in step["links"]}
        targets = {(p["trace_id"], p["span_id"]) for p in scored_publish[tid]}
        assert targets & linked, f"learner.step {step_no} does not link {tid}"
    for step in steps.values():
        attrs = step["attributes"]
        assert len(step["links"]) == attrs["slipstream.n_trajectories"] == plan.groups_per_step * plan.group_size

    # --- the step's weights: weights.publish (child) -> announce -> weights.apply on a worker ---------
    publishes = {s["attributes"]["slipstream.policy_version"]: s for s in spans.by_name["weights.publish"]}
    for step in steps.values():
        version = step["attributes"]["slipstream.policy_version"]
        pub = publishes[version]
        assert pub["service"] == "weight-publisher"
        assert (pub["trace_id"], pub["parent_span_id"]) == (step["trace_id"], step["span_id"])
        applies = spans.descendants(pub, "weights.apply")
        for apply in applies:
            assert apply["service"] == "rollout-worker"
            assert apply["trace_id"] == step["trace_id"]
            assert apply["attributes"]["slipstream.policy_version"] == version
            assert apply["attributes"]["slipstream.worker_id"].startswith("rollout-worker/")

    # --- and one task, end to end: from its task.publish to a worker applying what it trained -------
    # A worker may skip a version a newer one overtook, or stop before the last: not every task, but one.
    complete = []
    for tid, step_no in trained.items():
        pub = publishes[steps[step_no]["attributes"]["slipstream.policy_version"]]
        if any(a["attributes"].get("slipstream.applied") for a in spans.descendants(pub, "weights.apply")):
            complete.append(tid)
    assert complete, "no trained task's weights were applied by a worker"
