"""Forged weight announces during a live run: each is refused and counted, and training keeps its pace.

The five-process pipeline (shrunk) trains with the stack's per-run signing key. Once the learner
has taken INJECT_AT steps, an outsider with access to the bus and the object store publishes, on
`weights.announce`:

- a version far ahead whose manifest is signed with another key (`unknown_key`);
- a version far ahead with an unsigned manifest (`unsigned`);
- a version far ahead whose manifest is the newest real one with its version edited, its
  signature kept (a tampered manifest: `bad_signature`);
- a version far ahead with no manifest at all (`missing_manifest`);
- the newest real version under a fencing token nobody was granted (`fence`).

Before the fix one such announce stopped training for minutes while every service answered
ready. Asserted: the rollout worker refuses and counts every one by its reason (the task source
the far-ahead ones), neither ever takes a forged version, the learner's step rate after the
injection is at least half of what it was before, every service stays ready, and the worker ends
on the learner's last real version.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from slipstream.bus import connect_bus
from slipstream.bus.config import BusConfig
from slipstream.cli.spec import StackSpec, StoreSpec
from slipstream.cli.stack import Stack
from slipstream.cli.status import read_json
from slipstream.cli.training import PIPELINE, TrainingPlan, service_env, warm_start
from slipstream.schemas import WeightAnnounce, to_json
from slipstream.schemas.subjects import WEIGHTS_ANNOUNCE
from slipstream.store import LocalObjectStore
from slipstream.trust import SigningKey, sign_manifest
from slipstream.weights import manifest_key, read_manifest
from slipstream.weights.chain import latest_version

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RUN = "forge-e2e"
STEPS = 24
INJECT_AT = 8
AHEAD = 1000
WORKER_REASONS = {"unknown_key": 1, "unsigned": 1, "bad_signature": 1, "missing_manifest": 1, "fence": 1}


async def _until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.2)


def _status(port: int) -> tuple[int | None, dict[str, Any]]:
    code, body = read_json(port, "/readyz", 1.0)
    return code, (body or {}).get("status") or {}


def _rate(samples: list[tuple[float, int]], lo: int, hi: int) -> float:
    """Learner steps per second between the first sample at step >= lo and the first at step >= hi."""
    t_lo, s_lo = next((t, s) for t, s in samples if s >= lo)
    t_hi, s_hi = next((t, s) for t, s in samples if s >= hi)
    return (s_hi - s_lo) / max(t_hi - t_lo, 1e-6)


@pytest.mark.timeout(900)
async def test_forged_announces_are_refused_counted_and_training_keeps_its_pace(tmp_path: Path) -> None:
    plan = TrainingPlan(env="reverse", sft_steps=60, max_steps=STEPS, groups_per_step=4, group_size=8, heldout_tasks=8)
    run_dir = tmp_path / RUN
    model_dir, staging = run_dir / "model-init", run_dir / "staging"
    await asyncio.to_thread(warm_start, plan, model_dir)
    env = {
        **service_env(plan, model_dir, staging, run_dir / "learner-outcomes.jsonl"),
        "SLIPSTREAM_SERVICE__STALL_AFTER_S": "60",
    }
    store_root = run_dir / "data" / "store"
    spec = StackSpec(
        run_dir=run_dir, services=PIPELINE, store=StoreSpec(type="local", root=str(store_root)), run_id=RUN, env=env
    )
    stack = Stack(spec)
    samples: list[tuple[float, int]] = []
    codes: dict[str, set[int | None]] = {"rollout-worker": set(), "task-source": set(), "learner": set()}
    injected_at: float | None = None
    bus = None
    sampler: asyncio.Task[None] | None = None
    try:
        await asyncio.to_thread(stack.start)
        await asyncio.to_thread(stack.wait_ready)
        ports = {name: stack.services[name].port for name in codes}

        async def sample() -> None:
            while True:
                code, st = await asyncio.to_thread(_status, ports["learner"])
                if isinstance(st.get("step"), int):
                    samples.append((time.monotonic(), st["step"]))
                if injected_at is not None:
                    codes["learner"].add(code)
                    for name in ("rollout-worker", "task-source"):
                        codes[name].add((await asyncio.to_thread(_status, ports[name]))[0])
                await asyncio.sleep(0.25)

        sampler = asyncio.create_task(sample())
        await _until(lambda: bool(samples) and samples[-1][1] >= INJECT_AT, 400, f"learner step {INJECT_AT}")

        store = LocalObjectStore(store_root)
        newest = latest_version(store, RUN)
        assert newest is not None
        real = read_manifest(store, manifest_key(RUN, newest))
        assert real.key_id == stack.signing_key_id and real.fence_token > 0
        stranger = SigningKey.of(Ed25519PrivateKey.generate())
        far = newest + AHEAD
        forged = {
            "unknown_key": sign_manifest(msgspec.structs.replace(real, policy_version=far + 1), stranger),
            "unsigned": msgspec.structs.replace(real, policy_version=far + 2, key_id="", ed25519=""),
            "bad_signature": msgspec.structs.replace(real, policy_version=far + 3),
        }
        bus = await connect_bus(BusConfig(type="nats", url=stack.servers["nats"].url), name="forger")
        for reason, manifest in forged.items():
            key = manifest_key(RUN, manifest.policy_version)
            store.put(key, to_json(manifest))
            await bus.publish(
                WEIGHTS_ANNOUNCE,
                WeightAnnounce(
                    policy_version=manifest.policy_version, manifest_key=key, run_id=RUN, fence_token=real.fence_token
                ),
                msg_id=f"forged:{reason}",
            )
        await bus.publish(
            WEIGHTS_ANNOUNCE,
            WeightAnnounce(
                policy_version=far, manifest_key=manifest_key(RUN, far), run_id=RUN, fence_token=real.fence_token
            ),
            msg_id="forged:missing",
        )
        await bus.publish(
            WEIGHTS_ANNOUNCE,
            WeightAnnounce(
                policy_version=newest,
                manifest_key=manifest_key(RUN, newest),
                run_id=RUN,
                fence_token=real.fence_token + 1000,
            ),
            msg_id="forged:fence",
        )
        injected_at = time.monotonic()
        step_at_injection = samples[-1][1]

        def refused(name: str) -> dict[str, int]:
            st = _status(ports[name])[1]
            announces = (st.get("weights") or {}).get("announces") if name == "rollout-worker" else st.get("announces")
            return dict((announces or {}).get("refused") or {})

        await _until(lambda: refused("rollout-worker") == WORKER_REASONS, 30, "the worker to refuse all five")
        await _until(
            lambda: (
                {k: v for k, v in refused("task-source").items() if k != "fence"}
                == {k: 1 for k in WORKER_REASONS if k != "fence"}
            ),
            30,
            "the task source to refuse the four far-ahead versions",
        )
        worker = _status(ports["rollout-worker"])[1]
        assert worker["weights"]["fence_token"] == real.fence_token  # the spoofed token did not become the mark
        assert worker["policy_version"] < far and worker["weights"]["announced_version"] < far
        assert _status(ports["task-source"])[1]["latest_version"] < far

        learner = stack.services["learner"]
        await _until(lambda: not learner.alive(), 500, "the learner's last step")
        assert learner.returncode == 0, stack.tail("learner")
        final = _status(ports["rollout-worker"])[1]
        assert final["policy_version"] == STEPS, final
    finally:
        if sampler is not None:
            sampler.cancel()
            await asyncio.gather(sampler, return_exceptions=True)
        if bus is not None:
            await bus.close()
        await asyncio.to_thread(stack.stop)

    assert injected_at is not None
    before = _rate(samples, 2, step_at_injection)
    after = _rate(samples, step_at_injection, STEPS)
    print(f"\nlearner steps/s: before injection {before:.3f} (steps 2-{step_at_injection}), after {after:.3f}")
    assert after >= 0.5 * before, (before, after)
    # Nobody was stuck: every probe after the injection answered ready.
    assert codes["rollout-worker"] == {200}, codes
    # None: they exit once the learner has taken its last step.
    assert codes["task-source"] <= {200, None} and codes["learner"] <= {200, None}, codes
