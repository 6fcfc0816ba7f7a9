"""`slipstream top` against a running stack: one frame captured without a terminal.

The stack is the real one (nats-server, redis-server, the six services as processes). `top
--once` runs as a subprocess, as a person would run it, and its frame must name every service
with its health, every work stream, and the versions. The stage arithmetic (which stage is the
slowest) is checked on hand-made numbers.
"""

from __future__ import annotations

import io
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from stack_spec import full_stack_spec

from slipstream.run.top import Frame, Stage, render, slowest
from slipstream.schemas import LearnerStep, WeightAnnounce
from slipstream.stack.local import Stack
from slipstream.stack.spec import SERVICES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with Stack(full_stack_spec(tmp_path_factory.mktemp("top"))) as stack:
        stack.wait_ready(240)
        stack.write_state()
        yield stack.spec.run_dir


def top(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "top", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_one_frame_names_every_service_stream_and_version(run_dir: Path) -> None:
    out = top("--run-dir", str(run_dir), "--once", "--interval", "1")
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    assert f"run {run_dir.name} (ready)" in frame
    rows = {line.split("│")[1].strip(): line for line in frame.splitlines() if line.count("│") >= 6}
    for name in SERVICES:
        assert name in rows, f"no row for {name} in:\n{frame}"
        assert "ready" in rows[name], rows[name]
    for stream in ("TASKS", "TRAJ_RAW", "TRAJ_SCORED", "WEIGHTS"):
        assert stream in rows, f"no row for stream {stream} in:\n{frame}"
    (versions,) = [line for line in frame.splitlines() if line.startswith("versions:")]
    # The publisher announces the initial weights as version 0 at start, and workers apply it.
    assert "announced v0" in versions and "rollout-worker applies v0" in versions, versions
    assert "dead letters: 0" in frame
    # Rates need two samples; --once takes them, so the task source's publish rate is a number.
    assert rows["task-source"].split("│")[5].strip() != "-", rows["task-source"]


def test_a_missing_stack_file_is_a_clear_error(tmp_path: Path) -> None:
    out = top("--run-dir", str(tmp_path), "--once")
    assert out.returncode == 1
    assert f"no {tmp_path / 'stack.json'}" in out.stdout.replace("\n", "")


def test_the_slowest_stage_is_the_longest_to_drain_and_a_stall_beats_any_rate() -> None:
    a = Stage("TASKS", "rollout-worker", "rollout-worker", pending=100, in_progress=8, rate=50.0)  # 2 s
    b = Stage("TRAJ_RAW", "reward-model", "reward-model", pending=30, in_progress=0, rate=10.0)  # 3 s
    c = Stage("TRAJ_SCORED", "learner", "learner", pending=0, in_progress=64, rate=0.0)  # nothing waiting
    assert slowest([a, b, c]) is b
    stalled = Stage("WEIGHTS", "eval-gate", "eval-gate", pending=1, in_progress=0, rate=0.0)
    assert math.isinf(stalled.drain_s or 0.0) and slowest([a, b, c, stalled]) is stalled
    assert slowest([c, Stage("X", "y", "z")]) is None  # no backlog, or no figures: nothing to blame


def test_a_frame_renders_versions_sparklines_and_the_highlight() -> None:
    from rich.console import Console

    steps = [
        LearnerStep(step=i, policy_version=i, reward_mean=0.1 * i, accuracy=0.05 * i, staleness={"0": 6, "1": 2})
        for i in range(1, 6)
    ]
    stages = [
        Stage("TASKS", "rollout-worker", "rollout-worker", 5, 1, 0.5),
        Stage("TRAJ_RAW", "reward-model", "r", 0, 0, 9),
    ]
    frame = Frame(
        run_id="r1", state="ready", at=0.0, services=[], stages=stages, dead_letters=3, steps=steps,
        announced=WeightAnnounce(policy_version=5, manifest_key="k"), promoted=None, notes=["bus slow"],
    )  # fmt: skip
    console = Console(width=120, file=io.StringIO())
    console.print(render(frame))
    text = console.file.getvalue()  # type: ignore[attr-defined]
    assert "versions: learner step 5 -> v5 · announced v5 · promoted: none" in text
    assert "reward     0.500  ▁▂▄▆█" in text and "accuracy   0.250  ▁▂▄▆█" in text
    assert "staleness (versions behind: episodes) 0:6 1:2" in text
    assert "10 s ◀ slowest" in text and "dead letters: 3" in text and "note: bus slow" in text
