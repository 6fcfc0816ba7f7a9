"""What the shared demo run (conftest.demo_run) hands to the tests that read it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class DemoRun:
    plan: Any  # slipstream.run.TrainingPlan
    summary: Any  # the run's summary (slipstream.run.training)
    run_dir: Path
