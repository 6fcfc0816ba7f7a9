"""Weights published per learner rank, as separate processes: a 2-rank learner, a publisher per rank, a worker.

The pipeline of `slipstream demo` (shrunk) runs with `SLIPSTREAM_LEARNER__RANKS=2`, as a run file's
`[learner] ranks = 2` renders: the stack starts `weight-publisher` (rank 0) and `weight-publisher-1`;
the learner is a Ray driver whose two rank actors stage their own parts. Asserted:

- every committed version names both ranks' parts, and is signed;
- the rollout worker ends on the learner's last version with engine weights whose sha256 equals
  that of the learner's gathered weights (its last checkpoint's model, committed at every step);
- versions between keyframes were stored as deltas.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest
from e2e_support import until, worker_weights
from safetensors.torch import load as load_safetensors

from slipstream.learner.checkpoint import Pointer
from slipstream.run.training import PIPELINE, TrainingPlan, service_env, warm_start
from slipstream.stack.local import Stack
from slipstream.stack.spec import StackSpec, StoreSpec
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key, read_manifest
from slipstream.weights.parts import split_parts
from slipstream.weights.tensors import digest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
RUN = "rank-publish-e2e"
STEPS = 6
KEYFRAME_EVERY = 3


@pytest.mark.timeout(600)
async def test_two_learner_ranks_publish_parts_and_the_worker_ends_bit_identical(tmp_path: Path) -> None:
    plan = TrainingPlan(
        env="reverse", sft_steps=10, max_steps=STEPS, groups_per_step=2, group_size=4, worker_tasks_in_flight=4
    )
    run_dir = tmp_path / RUN
    model_dir = run_dir / "model-init"
    await asyncio.to_thread(warm_start, plan, model_dir)
    env = {
        **service_env(plan, model_dir, run_dir / "staging", run_dir / "learner-outcomes.jsonl"),
        "SLIPSTREAM_LEARNER__RANKS": "2",
        "SLIPSTREAM_PUBLISHER__KEYFRAME_EVERY": str(KEYFRAME_EVERY),
        "SLIPSTREAM_WORKER__WEIGHTS_DIGEST": "true",
    }
    store_root = run_dir / "data" / "store"
    spec = StackSpec(
        run_dir=run_dir,
        services=PIPELINE,
        store=StoreSpec(type="local", root=str(store_root)),
        run_id=RUN,
        env=env,
        ready_timeout_s=300,  # Ray's start in the learner takes 40-90 s on a loaded machine
    )
    stack = Stack(spec)
    try:
        await asyncio.to_thread(stack.start)
        assert {"weight-publisher", "weight-publisher-1"} <= set(stack.services)
        await asyncio.to_thread(stack.wait_ready)
        store = LocalObjectStore(store_root)
        learner = stack.services["learner"]
        await until(lambda: not learner.alive(), 400, "the learner's last step")
        assert learner.returncode == 0, stack.tail("learner")
        await until(lambda: store.exists(manifest_key(RUN, STEPS)), 120, f"version {STEPS} committed")
        port = stack.services["rollout-worker"].port
        await until(lambda: worker_weights(port)["version"] == STEPS, 120, f"the worker on version {STEPS}")

        pointer = msgspec.json.decode(store.get(f"checkpoints/{RUN}/latest.json"), type=Pointer)
        assert pointer.policy_version == STEPS
        gathered = load_safetensors(store.get(f"{pointer.chain[0]}/model.safetensors"))
        last = read_manifest(store, manifest_key(RUN, STEPS))
        staged = {e.name for e in last.tensors}
        assert staged <= set(gathered)
        assert worker_weights(port)["digest"] == digest({n: gathered[n] for n in staged})

        manifests = [read_manifest(store, manifest_key(RUN, v)) for v in range(STEPS + 1)]
        assert all([p.rank for p in m.parts] == [0, 1] and m.key_id == stack.signing_key_id for m in manifests)
        assert [m.keyframe for m in manifests] == [v % KEYFRAME_EVERY == 0 for v in range(STEPS + 1)]
        for m in manifests:
            for part, (_, shards) in zip(m.parts, split_parts(m), strict=True):
                assert all(f"/rank-{part.rank}/" in s.key for s in m.shards[shards])
    finally:
        await asyncio.to_thread(stack.stop)
