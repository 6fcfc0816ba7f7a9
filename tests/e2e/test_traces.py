"""One trace per task across every service: the acceptance test of end-to-end tracing.

The shared demo run of the five-process pipeline (tests/e2e/conftest.py, `traces=True`: every service writes
its spans to run_dir/traces.<service>.jsonl) is read back, and one task that was trained on is
followed through the spans, checking each span's service and its parent or link:

    task.publish (task-source, root) -> ... -> process tasks.* (rollout-worker)
      -> rollout.generate (rollout-worker) -> ... -> process traj.raw.* (reward-model)
      -> publish traj.scored.* (reward-model)  <-- linked from learner.step (learner, a new trace)
    learner.step -> weights.publish (weight-publisher, child) -> ... -> weights.apply (rollout-worker)

"->" is a direct parent; "-> ... ->" an ancestor, since the bus adds its own publish span
between a service's span and the consumer's.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from shared_run import DemoRun

from slipstream.cli.training import PIPELINE
from slipstream.telemetry.spanfile import read_spans

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

Span = dict[str, Any]


class Spans:
    """Span records indexed by id, parent and name."""

    def __init__(self, records: Iterable[Span]) -> None:
        self.all = list(records)
        self.by_id = {s["span_id"]: s for s in self.all}
        self.by_name: dict[str, list[Span]] = defaultdict(list)
        self.children: dict[str, list[Span]] = defaultdict(list)
        for s in self.all:
            self.by_name[s["name"]].append(s)
            if s["parent_span_id"]:
                self.children[s["parent_span_id"]].append(s)

    def ancestors(self, span: Span) -> list[Span]:
        """Parent, grandparent, ... as far as the files go (nearest first)."""
        out: list[Span] = []
        parent = span["parent_span_id"]
        while parent is not None and parent in self.by_id:
            out.append(self.by_id[parent])
            parent = out[-1]["parent_span_id"]
        return out

    def descendants(self, span: Span, name: str) -> list[Span]:
        found: list[Span] = []
        todo = [span]
        while todo:
            for child in self.children[todo.pop()["span_id"]]:
                if child["name"] == name:
                    found.append(child)
                todo.append(child)
        return found

    def nearest(self, span: Span, prefix: str) -> Span | None:
        """The closest ancestor whose name starts with `prefix`."""
        return next((a for a in self.ancestors(span) if a["name"].startswith(prefix)), None)


def trained_ids(run_dir: Path) -> dict[str, int]:
    """trajectory id -> step, for every trajectory the learner trained (its outcomes log)."""
    out: dict[str, int] = {}
    for line in (run_dir / "learner-outcomes.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["outcome"] == "trained":
            out[record["trajectory_id"]] = record["step"]
    return out


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
    assert len(trained) == plan.max_steps * plan.groups_per_step * plan.group_size

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
