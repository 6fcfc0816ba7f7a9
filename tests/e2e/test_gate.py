"""The eval gate in a training run: promotions, a rejected corrupted candidate, a rollback that serving follows.

A demo-sized run as separate processes: the five-process pipeline of `slipstream demo` (the
lead's `warm_start` and `service_env`, shrunk to a few learner steps) plus eval-gate, plus a
second rollout worker in serving mode (`[worker] follow = "promoted"`, started next to the stack
because the stack runs one process per service). The run is driven here rather than through
`run_training`, which stops the stack as soon as the learner is done: the corrupted candidate
has to be injected after the learner's last version (a version number is never reused) and
before the stack goes down. Asserted:

- the gate judges every second version and promotes at least one version after v0;
- a corrupted candidate (every tensor replaced by randn x 10) published as the next due version
  is rejected with a reason, no `weights.promoted` names it, and the serving worker never
  reports it (its /readyz is sampled throughout);
- the serving worker only ever applies promoted versions;
- `slipstream status --json` shows the promoted version and the gate's last result;
- `slipstream rollback` moves the serving worker back to the previously promoted version within
  a few seconds.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from slipstream.bus import Bus, connect_bus
from slipstream.run.training import PIPELINE, TrainingPlan, service_env, warm_start
from slipstream.schemas import EvalResult, WeightAnnounce, WeightsPromoted
from slipstream.schemas.subjects import EVAL_RESULT, WEIGHTS_ANNOUNCE, WEIGHTS_PROMOTED
from slipstream.stack import ManagedProcess, free_port
from slipstream.stack.local import Stack
from slipstream.stack.spec import StackSpec, StoreSpec
from slipstream.stack.status import read_json
from slipstream.store import LocalObjectStore
from slipstream.trust import load_signing_key, sign_manifest
from slipstream.weights import fetch_version, manifest_key, publish_snapshot

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RUN = "gate-e2e"
EVERY = 2
STEPS = 4  # a multiple of EVERY: the learner's last version is judged
GATE_ENV = {
    "SLIPSTREAM_GATE__EVERY_N_VERSIONS": str(EVERY),
    "SLIPSTREAM_GATE__SUITE_SIZE": "24",
    "SLIPSTREAM_GATE__MIN_SAMPLES": "8",
    # The floor rejects what cannot even answer in format; the generous margin lets a few RL
    # steps through whatever their greedy answers do, so the test does not hinge on learning.
    "SLIPSTREAM_GATE__FLOOR": "0.05",
    "SLIPSTREAM_GATE__MARGIN": "0.5",
    "SLIPSTREAM_GATE__RETRY_DELAY_S": "1.0",
}
SERVING_ENV = {
    "SLIPSTREAM_WORKER__FOLLOW": "promoted",
    "SLIPSTREAM_SERVICE__REPLICA": "serving-0",
    # It shares the task queue with the training worker: hold little, give back fast.
    "SLIPSTREAM_WORKER__MAX_TASKS_IN_FLIGHT": "1",
    "SLIPSTREAM_WORKER__VERSION_WAIT_TIMEOUT_S": "1.0",
    "SLIPSTREAM_WORKER__RETRY_DELAY_S": "0.5",
}


def _plan() -> TrainingPlan:
    return TrainingPlan(
        env="reverse",
        sft_steps=60,  # clean one-word answers (format reward) on held-out tasks: above the floor
        max_steps=STEPS,
        group_size=8,
        groups_per_step=4,
        worker_max_batch=32,
        worker_tasks_in_flight=8,
    )


async def _until(pred: Callable[[], bool], timeout: float, what: str, *, tail: Callable[[], str] = str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout}s waiting for {what}\n{tail()}"
        await asyncio.sleep(0.1)
    return time.monotonic() - t0


async def _tap(bus: Bus, subject: str, cls: type[Any], into: list[Any]) -> None:
    async for d in bus.subscribe(subject, cls, deliver="all"):
        if d.msg.run_id == RUN:
            into.append(d.msg)


class ServingProbe:
    """Samples the serving worker's /readyz: every version it ever reported, and the current one."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.seen: set[int] = set()
        self.applied: list[int] = []
        self.version: int | None = None
        self.changed_at = 0.0  # unix time the current version was first seen

    async def run(self) -> None:
        while True:
            code, body = await asyncio.to_thread(read_json, self.port, "/readyz", 0.5)
            st = (body or {}).get("status") or {}
            if code == 200 and isinstance(st.get("policy_version"), int):
                if st["policy_version"] != self.version:
                    self.changed_at = time.time()
                self.version = st["policy_version"]
                self.seen.add(self.version)
                self.applied = list((st.get("weights") or {}).get("applied_versions") or [])
                self.seen.update(self.applied)
            await asyncio.sleep(0.2)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "slipstream.cli", *args], capture_output=True, text=True, timeout=120, check=False
    )


@pytest.mark.timeout(420)
async def test_gate_promotes_rejects_corruption_and_serving_rolls_back(tmp_path: Path) -> None:
    plan = _plan()
    run_dir = (tmp_path / "run").resolve()
    model_dir, staging = run_dir / "model-init", run_dir / "staging"
    await asyncio.to_thread(warm_start, plan, model_dir)
    env = {**service_env(plan, model_dir, staging, run_dir / "learner-outcomes.jsonl"), **GATE_ENV}
    env["SLIPSTREAM_GATE__ENVS"] = json.dumps([plan.env])
    spec = StackSpec(
        run_dir=run_dir,
        services=(*PIPELINE, "eval-gate"),
        store=StoreSpec(type="local", root=str(run_dir / "data" / "store")),
        run_id=RUN,
        env=env,
        ready_timeout_s=240.0,
        drain_timeout_s=10.0,
    )
    stack = Stack(spec)
    serving: ManagedProcess | None = None
    jobs: list[asyncio.Task[Any]] = []
    bus: Bus | None = None
    try:
        await asyncio.to_thread(stack.start)
        port = free_port()
        serving = ManagedProcess(
            "serving-worker",
            [sys.executable, "-m", "slipstream.rollout_worker"],
            stack.spec.log_dir / "serving-worker.log",
            {**stack.service_env("rollout-worker", port), **SERVING_ENV},
        )
        await asyncio.to_thread(stack.wait_ready)
        stack.write_state()
        probe = ServingProbe(port)
        serving_log = serving.tail
        await _until(lambda: read_json(port, "/readyz")[0] == 200, 120, "serving worker ready", tail=serving_log)

        bus = await connect_bus(stack.admin_bus(), name="gate-e2e")
        results: list[EvalResult] = []
        promotions: list[WeightsPromoted] = []
        announces: list[WeightAnnounce] = []
        jobs = [
            asyncio.create_task(_tap(bus, EVAL_RESULT, EvalResult, results)),
            asyncio.create_task(_tap(bus, WEIGHTS_PROMOTED, WeightsPromoted, promotions)),
            asyncio.create_task(_tap(bus, WEIGHTS_ANNOUNCE, WeightAnnounce, announces)),
            asyncio.create_task(probe.run()),
        ]

        gate_log = stack.services["eval-gate"].process.tail
        # Training: the learner makes STEPS versions and exits; the gate judges v0, v2, ..., vSTEPS.
        await _until(lambda: any(r.policy_version == STEPS for r in results), 240, f"v{STEPS} judged", tail=gate_log)
        wins = sum(r.decision == "promote" for r in results)
        await _until(lambda: len(promotions) >= wins, 20, "the promotions of the judged versions", tail=gate_log)
        judged = [r.policy_version for r in results]
        # Every due version, unless the gate fetched two at once and judged only the newer one.
        assert judged[0] == 0 and set(judged) <= set(range(0, STEPS + 1, EVERY)), judged
        promoted = [p.policy_version for p in promotions]
        assert promoted and promoted[0] == 0, (promoted, [r.reason for r in results])
        assert any(v > 0 for v in promoted), [(r.policy_version, r.decision, r.reason) for r in results]
        current, before = promoted[-1], promoted[-2]
        await _until(lambda: probe.version == current, 30, f"serving worker on v{current}", tail=serving_log)

        # A corrupted candidate, published as the next due version after the learner's last one
        # and signed with the run's key (a bad version from the learner itself, not a forgery:
        # tests/e2e/test_forged_announces.py has those).
        await _until(lambda: not stack.services["learner"].alive(), 60, "learner done")
        store = LocalObjectStore(stack.spec.store.root if stack.spec.store else "")
        _, good = await asyncio.to_thread(fetch_version, store, manifest_key(RUN, STEPS))
        g = torch.Generator().manual_seed(7)
        noise = {n: (torch.randn(t.shape, generator=g) * 10).to(t.dtype) for n, t in good.items()}
        bad = STEPS + EVERY
        run_key = load_signing_key(stack.spec.data_dir / "keys" / "weights-signing.pem")
        key, _ = await asyncio.to_thread(
            publish_snapshot,
            store,
            run_id=RUN,
            version=bad,
            tensors=noise,
            seal=lambda m: sign_manifest(m, run_key),
        )
        await bus.publish(
            WEIGHTS_ANNOUNCE, WeightAnnounce(policy_version=bad, manifest_key=key, run_id=RUN), msg_id=f"corrupt-{bad}"
        )
        await _until(lambda: any(r.policy_version == bad for r in results), 60, f"v{bad} judged", tail=gate_log)
        verdict = next(r for r in results if r.policy_version == bad)
        assert verdict.decision == "reject" and verdict.reason, verdict
        assert verdict.score < 0.05 and verdict.baseline_version == current, verdict
        await asyncio.sleep(2.0)  # time for a (wrong) promotion to reach the serving worker
        assert bad not in [p.policy_version for p in promotions]
        assert probe.version == current and bad not in probe.seen, (probe.version, probe.seen)
        # Serving only ever held promoted versions (or its initial weights, version 0).
        assert probe.seen <= {0, *promoted}, (probe.seen, promoted)

        shown = await asyncio.to_thread(_cli, "status", "--run-dir", str(run_dir), "--json")
        status = json.loads(shown.stdout)
        assert status["versions"]["promoted"] == current, status["versions"]
        assert status["versions"]["last_eval"]["policy_version"] == bad
        assert status["versions"]["last_eval"]["decision"] == "reject"
        assert {s["name"]: s["health"] for s in status["services"]}["eval-gate"] == "ready"

        done = await asyncio.to_thread(_cli, "rollback", "--run-dir", str(run_dir), "--reason", "e2e")
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"v{current} -> v{before}" in done.stdout
        await _until(lambda: probe.version == before, 10, f"serving back on v{before}", tail=serving_log)
        back = promotions[-1]
        assert (back.policy_version, back.previous_version, back.reason) == (before, current, "rollback: e2e")
        assert bad not in probe.seen
        took = probe.changed_at - back.promoted_at
        assert took < 5.0, took
        judged_as = [(r.policy_version, r.decision, round(r.score, 3)) for r in results]
        print(f"judged {judged_as}; rollback v{current} -> v{before} reached serving in {took:.2f}s (0.2s probe)")
    finally:
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        if bus is not None:
            await bus.close()
        if serving is not None:
            await asyncio.to_thread(serving.stop, 15.0)
        await asyncio.to_thread(stack.stop)
