"""One shrunk demo run shared by the e2e tests that only read what a run leaves behind.

test_demo_run.py's two tests (it learns, everything is accounted for, the report; one trace
per task across the services) assert on the same kind of run; starting the five-process
stack, warm-starting and evaluating once for both saves a whole run of CI time. The run writes
its spans (`traces=True`), which changes nothing in what it trains.
"""

from __future__ import annotations

import pytest
from shared_run import DemoRun

from slipstream.run.presets import demo_plan
from slipstream.run.training import run_training


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    plan = demo_plan()
    plan.max_steps = 45
    plan.eval_every = 0
    run_dir = tmp_path_factory.mktemp("demo-run") / "run"
    summary = run_training(plan, run_dir, traces=True)
    assert summary.ok, summary.error
    return DemoRun(plan, summary, run_dir)
