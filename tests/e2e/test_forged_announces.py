"""Forged weight announces during a live run: each is refused and counted, and training keeps its pace.

Two identical shrunk pipelines train side by side from the same warm start, each with its stack's
own signing key, so both see the same machine at the same time: one is the control. Once the
other's learner has taken INJECT_AT steps, an outsider with access to its bus and object store
publishes, on `weights.announce`:

- a version far ahead whose manifest is signed with another key (`unknown_key`);
- a version far ahead with an unsigned manifest (`unsigned`);
- a version far ahead whose manifest is the newest real one with its version edited, its
  signature kept (a tampered manifest: `bad_signature`);
- a version far ahead with no manifest at all (`missing_manifest`);
- the newest real version under a fencing token nobody was granted (`fence`).

Before the fix one such announce stopped training for minutes while every service answered
ready. Asserted: the rollout worker refuses and counts every one by its reason (the task source
the far-ahead ones), neither ever takes a forged version nor the spoofed token, every service
stays ready, the worker ends on the learner's last real version, and the attacked run takes its
remaining steps about as fast as the control takes the same steps (at most 4x the time: two runs
sharing a loaded machine differed by up to 2.8x, and no gap between two steps near the 120 s a worker
waits for a task's min_policy_version).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from e2e_support import until

from slipstream.bus import connect_bus
from slipstream.run.training import PIPELINE, TrainingPlan, service_env, warm_start
from slipstream.schemas import WeightAnnounce, to_json
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.stack.local import Stack
from slipstream.stack.spec import StackSpec, StoreSpec
from slipstream.stack.status import read_json
from slipstream.store import LocalObjectStore
from slipstream.trust import SigningKey, sign_manifest
from slipstream.weights import manifest_key, read_manifest
from slipstream.weights.chain import latest_version

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
# 10 steps after the injection (was 16 of 24, injected at 8): the task source's window is 3 steps
# of groups (4 groups x (staleness 2 + 1)), so at most the first 3 steps after it can train tasks
# published before it; the other 7 need tasks published after it, which is where a forged version
# taken as latest stalled the run (min_policy_version above every real version: a gap of minutes).
# One real version (fence token > 0) is all the forgeries copy; 4 steps give a few before.
STEPS = 14
INJECT_AT = 4
AHEAD = 1000
WORKER_REASONS = {"unknown_key": 1, "unsigned": 1, "bad_signature": 1, "missing_manifest": 1, "fence": 1}


def _probe(port: int) -> tuple[int | None, dict[str, Any], str]:
    """/readyz: the code, the service's status and the runtime's state (running, draining, ...)."""
    code, body = read_json(port, "/readyz", 1.0)
    return code, (body or {}).get("status") or {}, str((body or {}).get("state") or "")


def _status(port: int) -> tuple[int | None, dict[str, Any]]:
    code, status, _ = _probe(port)
    return code, status


@dataclass
class Run:
    """One pipeline's observations: when each learner step was first seen, probe answers after the injection."""

    name: str
    steps: dict[int, float] = field(default_factory=dict)
    codes: dict[str, set[int | None]] = field(
        default_factory=lambda: {"rollout-worker": set(), "task-source": set(), "learner": set()}
    )
    refused: dict[str, dict[str, int]] = field(default_factory=dict)
    worker: dict[str, Any] = field(default_factory=dict)
    source_version: int = -1
    final_version: int | None = None

    def at(self, step: int) -> float:
        """When the learner was first seen at `step` or later (probes can miss a step)."""
        return min(t for s, t in self.steps.items() if s >= step)

    def seconds(self, lo: int, hi: int) -> float:
        return self.at(hi) - self.at(lo)

    def longest_gap(self, lo: int, hi: int) -> float:
        seen = sorted(s for s in self.steps if lo <= s <= hi)
        return max(self.steps[b] - self.steps[a] for a, b in itertools.pairwise(seen))


def _refused(port: int, name: str) -> dict[str, int]:
    st = _status(port)[1]
    announces = (st.get("weights") or {}).get("announces") if name == "rollout-worker" else st.get("announces")
    return dict((announces or {}).get("refused") or {})


async def _forge(stack: Stack, store: LocalObjectStore, run_id: str) -> int:
    """Publish the five forgeries; returns the first far-ahead version."""
    newest = latest_version(store, run_id)
    assert newest is not None
    real = read_manifest(store, manifest_key(run_id, newest))
    assert real.key_id == stack.signing_key_id and real.fence_token > 0
    stranger = SigningKey.of(Ed25519PrivateKey.generate())
    far = newest + AHEAD
    forged = {
        "unknown_key": sign_manifest(msgspec.structs.replace(real, policy_version=far + 1), stranger),
        "unsigned": msgspec.structs.replace(real, policy_version=far + 2, key_id="", ed25519=""),
        "bad_signature": msgspec.structs.replace(real, policy_version=far + 3),
    }
    # As the stack's NATS admin: even a forger with every bus right is stopped by the signatures.
    bus = await connect_bus(stack.admin_bus(), name="forger")
    try:
        for reason, manifest in forged.items():
            key = manifest_key(run_id, manifest.policy_version)
            store.put(key, to_json(manifest))
            announce = WeightAnnounce(
                policy_version=manifest.policy_version, manifest_key=key, run_id=run_id, fence_token=real.fence_token
            )
            await bus.publish(WEIGHTS_ANNOUNCE, announce, msg_id=f"forged:{reason}")
        missing = WeightAnnounce(
            policy_version=far, manifest_key=manifest_key(run_id, far), run_id=run_id, fence_token=real.fence_token
        )
        await bus.publish(WEIGHTS_ANNOUNCE, missing, msg_id="forged:missing")
        spoofed = WeightAnnounce(
            policy_version=newest,
            manifest_key=manifest_key(run_id, newest),
            run_id=run_id,
            fence_token=real.fence_token + 1000,
        )
        await bus.publish(WEIGHTS_ANNOUNCE, spoofed, msg_id="forged:fence")
    finally:
        await bus.close()
    return far


async def _train(run: Run, root: Path, plan: TrainingPlan, model_dir: Path, *, attack: bool) -> None:
    run_dir = root / run.name
    env = {
        **service_env(plan, model_dir, run_dir / "staging", run_dir / "learner-outcomes.jsonl"),
        "SLIPSTREAM_SERVICE__STALL_AFTER_S": "60",
    }
    store_root = run_dir / "data" / "store"
    spec = StackSpec(
        run_dir=run_dir,
        services=PIPELINE,
        store=StoreSpec(type="local", root=str(store_root)),
        run_id=run.name,
        env=env,
        home=root / "home",
    )
    stack = Stack(spec)
    injected = False
    sampler: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(stack.start)
        await asyncio.to_thread(stack.wait_ready)
        ports = {name: stack.services[name].port for name in run.codes}

        async def sample() -> None:
            for n in itertools.count():
                code, st, state = await asyncio.to_thread(_probe, ports["learner"])
                if isinstance(st.get("step"), int):
                    run.steps.setdefault(st["step"], time.monotonic())
                if injected:
                    # After its last step the learner drains and exits: a 503 then (state draining or
                    # stopping, or the last step already taken) is the run ending, not a stall.
                    ending = code == 503 and (state != "running" or st.get("step") == STEPS)
                    run.codes["learner"].add(None if ending else code)
                    if n % 4 == 0:  # the others once a second: probing must not slow what it measures
                        for name in ("rollout-worker", "task-source"):
                            run.codes[name].add((await asyncio.to_thread(_status, ports[name]))[0])
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample())
        await until(lambda: max(run.steps, default=0) >= INJECT_AT, 500, f"{run.name}: learner step {INJECT_AT}")
        if attack:
            far = await _forge(stack, LocalObjectStore(store_root), run.name)
            injected = True
            worker, source = ports["rollout-worker"], ports["task-source"]
            await until(lambda: _refused(worker, "rollout-worker") == WORKER_REASONS, 30, "the worker's refusals")
            four = {k: 1 for k in WORKER_REASONS if k != "fence"}
            await until(
                lambda: {k: v for k, v in _refused(source, "task-source").items() if k != "fence"} == four,
                30,
                "the task source's refusals",
            )
            run.refused = {"rollout-worker": _refused(worker, "rollout-worker")}
            run.worker = _status(worker)[1]
            run.source_version = int(_status(source)[1]["latest_version"])
            assert run.source_version < far and run.worker["policy_version"] < far
        else:
            injected = True
        learner = stack.services["learner"]
        await until(lambda: not learner.alive(), 600, f"{run.name}: the learner's last step")
        run.steps.setdefault(STEPS, time.monotonic())  # its last /readyz may have gone unseen before the exit
        assert learner.returncode == 0, stack.tail("learner")
        worker = ports["rollout-worker"]
        await until(lambda: _status(worker)[1].get("policy_version") == STEPS, 60, f"{run.name}: worker on v{STEPS}")
        run.final_version = STEPS
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        await asyncio.to_thread(stack.stop)


@pytest.mark.timeout(1200)
async def test_forged_announces_are_refused_counted_and_training_keeps_its_pace(tmp_path: Path) -> None:
    plan = TrainingPlan(env="reverse", sft_steps=60, max_steps=STEPS, groups_per_step=4, group_size=8, heldout_tasks=8)
    model_dir = tmp_path / "model-init"
    await asyncio.to_thread(warm_start, plan, model_dir)
    control, attacked = Run("forge-control"), Run("forge-attacked")
    await asyncio.gather(
        _train(control, tmp_path, plan, model_dir, attack=False),
        _train(attacked, tmp_path, plan, model_dir, attack=True),
    )

    assert attacked.refused["rollout-worker"] == WORKER_REASONS
    weights = attacked.worker["weights"]
    assert weights["fence_token"] < 1000 and weights["announced_version"] < AHEAD  # no forgery became the mark
    assert attacked.final_version == control.final_version == STEPS
    # Nobody was stuck: every probe after the injection answered ready (None: exited or draining after
    # the last step).
    for run in (control, attacked):
        assert run.codes["rollout-worker"] <= {200, None} and 200 in run.codes["rollout-worker"], run.codes
        assert run.codes["task-source"] <= {200, None} and run.codes["learner"] <= {200, None}, run.codes
    figures = {
        run.name: {
            "s_steps_1_to_inject": round(run.seconds(1, INJECT_AT), 2),
            "s_inject_to_last": round(run.seconds(INJECT_AT, STEPS), 2),
            "longest_gap_s_after": round(run.longest_gap(INJECT_AT, STEPS), 2),
        }
        for run in (control, attacked)
    }
    print(f"\npace, {STEPS} steps, forgeries injected at step {INJECT_AT} of {attacked.name}: {figures}")
    # Two runs sharing a machine differ by up to ~35% either way when only they load it (measured:
    # attacked/control 0.76, 0.90 and 1.35), and by 2.8x beside the other e2e worker's training and a
    # third job (attacked 60.7 s against 21.4 s, its longest gap 9.2 s; alone again: 29.3 against
    # 32.5). The stall this guards against is a gap of minutes, caught by the second check; the
    # ratio only catches a run that crawls without one stall.
    assert attacked.seconds(INJECT_AT, STEPS) <= 4.0 * control.seconds(INJECT_AT, STEPS), figures
    assert attacked.longest_gap(INJECT_AT, STEPS) < 60.0, figures
