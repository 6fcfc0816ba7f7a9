"""The multi-turn tool-use demo's path, shrunk: `lookup` through the whole local stack.

`run_training` with the `slipstream demo --env lookup` plan cut to a few steps: the micro model
is warm-started on the scripted expert's episodes, then rollout-worker (the env's own episode
loop: tool calls parsed, executed and logged, results fed back as observation tokens),
reward-model (whole-episode scoring with the invalid-call penalty), learner, weight-publisher
and task-source run as separate processes. What it proves is the path, not learning (a few
steps cannot guarantee a rise; the per-seed figures are in libs/envs/README.md):

- the warm-start is the expert's (its loss falls) and the policy calls the tool while it is
  trained (the learner's per-step episode figures: turns per episode, tool calls per turn);
- every learner step ran, every version was published, every episode is accounted for;
- the summary carries held-out and train accuracy and the invalid-call rate, before and after;
- with `[replicas] tool-service = 2` the stack starts two replicas first, the workers call `get`
  over NATS request/reply, both replicas serve calls and no episode is masked as an infra error.

One run covers both (the in-process tool path runs in tests/integration/test_tool_worker.py and
the contract suite): each whole-stack run costs a warm-start and two evals of CI time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.run.presets import demo_plan
from slipstream.run.training import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_lookup_demo_path_with_its_tool_in_two_tool_service_replicas(tmp_path: Path) -> None:
    plan = demo_plan("lookup")
    plan.max_steps = 3
    plan.sft_steps = 150
    plan.sft_settle_steps = 0  # the path, not the demo's competence: no settle steps past the cap
    plan.eval_every = 0
    plan.heldout_tasks = 16
    plan.train_eval_tasks = 16
    plan.heldout_samples = 2
    plan.tool_service_replicas = 2
    # Valid calls after 150 supervised steps (only valid ones reach a replica): the perfect expert,
    # and the lr that learns the call format fastest.
    plan.env_options = {}
    plan.sft_lr = 3e-3
    run = tmp_path / "run"
    summary = run_training(plan, run, traces=True)
    assert summary.ok, summary.error

    assert summary.warmstart["loss_last"] < summary.warmstart["loss_first"] / 4
    assert summary.steps == plan.max_steps
    assert summary.versions_published == plan.max_steps + 1
    tr = summary.trajectories
    assert tr["accounted_raw"] and tr["accounted_scored"], tr
    assert (
        tr["trained"] + sum((tr["dropped"] or {}).values()) >= plan.max_steps * plan.groups_per_step * plan.group_size
    )
    # Masked episodes would be dropped as infra_error: the replicas answered every call.
    assert "infra_error" not in (tr["dropped"] or {}), tr["dropped"]

    for acc in (
        summary.heldout_accuracy_before,
        summary.heldout_accuracy_after,
        summary.train_accuracy_before,
        summary.train_accuracy_after,
    ):
        assert 0.0 <= acc <= 1.0
    for rate in (summary.heldout_invalid_call_rate_before, summary.heldout_invalid_call_rate_after):
        assert 0.0 <= rate <= 1.0
    # The policy played multi-turn episodes and called the tool while it was trained.
    assert all(row["turns_per_episode"] >= 1.0 for row in summary.steps_log)
    assert sum(row["tool_calls_per_turn"] for row in summary.steps_log) > 0
    assert [row["version"] for row in summary.eval_curve] == [0, summary.final_version]
    assert all("invalid_call_rate" in row and "train_accuracy" in row for row in summary.eval_curve)

    # Both replicas served calls: each wrote a server span per call it ran.
    served = {
        name: sum(
            json.loads(line)["name"] == "tool get" for line in (run / f"traces.{name}.jsonl").read_text().splitlines()
        )
        for name in ("tool-service", "tool-service-2")
    }
    assert all(n > 0 for n in served.values()), served
