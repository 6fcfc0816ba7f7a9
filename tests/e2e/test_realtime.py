"""`slipstream demo --realtime` shrunk to one promote cycle: serve -> feedback -> learn -> gate -> serve closes.

The real thing end to end as separate processes (a serving rollout worker with the endpoint on,
reward-model with the `serve` reward spec, learner, weight-publisher, eval-gate), driven by the
traffic simulator through the real `openai` client. Asserted: sessions were served and recorded,
the users' feedback was recorded and released to the learner as scored episodes, the learner
trained on them, the gate judged and promoted the trained version, and the serving worker then
served it (answers carry its version); the summary has every per-cycle field.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from slipstream.run.presets import demo_plan
from slipstream.run.realtime import RealtimePlan, run_realtime

pytestmark = [pytest.mark.e2e]


@pytest.mark.timeout(240)
async def test_realtime_loop_closes_one_promote_cycle(tmp_path: Path) -> None:
    rt = RealtimePlan(
        seed=0,
        cycles=1,
        steps_per_cycle=1,
        groups_per_step=2,
        # A short fixed warm-start: answers of letters, some of them the word's (both verdicts occur,
        # so groups are not uniform); the loop, not learning, is what this test checks.
        sft_steps=60,
        sft_target=0.0,
        users=8,
        concurrency=8,
        gate_suite_size=16,
        gate_margin=1.0,
        timeout_s=150.0,
    )
    summary = await asyncio.to_thread(run_realtime, rt, demo_plan("reverse"), tmp_path / "run")
    assert summary["ok"], summary["error"]
    rows = summary["cycles"]
    assert [r["version"] for r in rows] == [0, 1], rows
    first, trained = rows
    # Users were served by both versions and judged every answer.
    assert first["answers"] > 0 and trained["answers"] > 0, rows
    for key in ("acceptance", "acceptance_first_turn", "serving_at", "promoted_at"):
        assert trained[key] is not None, key
    assert summary["feedback"].get("recorded", 0) > 0, summary["feedback"]
    # Released with its feedback, scored by the spec, trained into v1, judged and promoted.
    assert summary["trained_episodes"] >= rt.groups_per_step * rt.group_size
    assert trained["batch_episodes"] >= rt.group_size
    assert trained["gate"]["passed"] and trained["gate"]["decision"] == "promote"
    assert trained["loop_time_s"] > 0 and trained["serving_at"] >= trained["promoted_at"]
    assert trained["staleness"]["tokens"] > 0 and trained["staleness"]["max"] >= 0
    assert summary["gate_passed_every_promotion"] and summary["cycles_completed"] == 1
    assert (tmp_path / "run" / "realtime.json").exists()
