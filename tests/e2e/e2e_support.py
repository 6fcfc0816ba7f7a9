"""What the e2e tests share: small waits and probes (what the services report on /readyz), and a
shrunk training run on the whole stack with every published rollout tapped (`train_and_tap`)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import torch

from slipstream.engine import CausalLM
from slipstream.engine.loading import load_pretrained
from slipstream.learner.outcomes import Outcome, read_outcomes
from slipstream.run.training import PIPELINE, TrainingPlan, service_env
from slipstream.schemas import SCHEMA_HEADER, Episode, decode_message
from slipstream.stack.local import Stack
from slipstream.stack.spec import StackSpec, StoreSpec
from slipstream.stack.status import read_json
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key
from slipstream.weights.chain import load_version


async def until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Poll `cond` every 0.2 s; fail naming `what` after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(0.2)


def worker_weights(port: int) -> dict[str, Any]:
    """A rollout worker's /readyz code, policy version and weights digest (`weights_sha256`)."""
    code, body = read_json(port, "/readyz", 1.0)
    st = (body or {}).get("status") or {}
    return {
        "code": code,
        "version": st.get("policy_version"),
        "digest": (st.get("weights") or {}).get("weights_sha256"),
    }


@dataclass
class TappedRun:
    """A shrunk training run on the whole stack, with every rollout the workers published."""

    run: str
    model_dir: Path
    store: LocalObjectStore
    episodes: list[Episode]
    """Every rollout seen on `traj.raw.>` (what the reward model received), in arrival order."""
    trained: list[Outcome]


async def train_and_tap(plan: TrainingPlan, run_dir: Path, run: str, *, steps_timeout_s: float = 420.0) -> TappedRun:
    """Run `plan` (its initial model already in `run_dir/model-init`) on the five pipeline processes
    plus the eval-gate, each building the env from its name and options only, while an admin tap
    records every published rollout; wait for the learner's `plan.max_steps` steps and that version
    stored. Checks that every trained trajectory is one the tap saw and that the env is `plan.env`.

    The engine re-prefills a row after a weight update (RECOMPUTE_KV_ON_UPDATE): a row prefilled
    under v1 and sampled under v2 would otherwise be neither version's alone, and a one-version
    sample must teacher-force to exactly its recorded log-probs."""
    model_dir, store_root = run_dir / "model-init", run_dir / "data" / "store"
    outcomes = run_dir / "learner-outcomes.jsonl"
    env = service_env(plan, model_dir, run_dir / "staging", outcomes)
    env["SLIPSTREAM_GATE__ENVS"] = json.dumps([plan.env])
    env["SLIPSTREAM_WORKER__RECOMPUTE_KV_ON_UPDATE"] = "true"
    spec = StackSpec(
        run_dir=run_dir,
        services=(*PIPELINE, "eval-gate"),
        store=StoreSpec(type="local", root=str(store_root)),
        run_id=run,
        env=env,
        ready_timeout_s=240.0,
        drain_timeout_s=10.0,
    )
    stack = Stack(spec)
    episodes: list[Episode] = []
    tap = None
    store = LocalObjectStore(store_root)
    try:
        await asyncio.to_thread(stack.start)
        tap = await nats.connect(stack.servers["nats"].url, **stack.admin_nats_options())

        async def on_traj(msg: Any) -> None:
            episodes.append(decode_message(msg.data, (msg.headers or {}).get(SCHEMA_HEADER), Episode))

        await tap.subscribe("traj.raw.>", cb=on_traj)
        await asyncio.to_thread(stack.wait_ready)  # the worker, reward model and eval-gate built the env by name
        learner = stack.services["learner"]
        await until(lambda: not learner.alive(), steps_timeout_s, f"the learner's {plan.max_steps} steps")
        assert learner.returncode == 0, stack.tail("learner")
        await until(lambda: store.exists(manifest_key(run, plan.max_steps)), 60, f"version {plan.max_steps} stored")
    finally:
        if tap is not None:
            await tap.close()
        await asyncio.to_thread(stack.stop)
    trained = [o for o in read_outcomes(outcomes) if o.outcome == "trained"]
    assert trained and max(o.step for o in trained) == plan.max_steps
    assert episodes and {e.env for e in episodes} == {plan.env}
    assert {o.trajectory_id for o in trained} <= {e.episode_id for e in episodes}  # trained on what the tap saw
    return TappedRun(run, model_dir, store, episodes, trained)


async def one_version_rollouts(tapped: TappedRun) -> AsyncIterator[tuple[Episode, int, CausalLM]]:
    """Each tapped single-sample rollout sampled under one weight version, with the model loaded at
    that version (fp32, eval mode): (episode, version, model). A rollout a weight update landed inside
    is two models' work and is skipped."""
    model, _ = load_pretrained(tapped.model_dir, dtype=torch.float32, device="cpu")
    model.eval()
    weights: dict[int, dict[str, torch.Tensor]] = {}
    for ep in tapped.episodes:
        (sample,) = ep.samples
        versions = set(sample.versions())
        if len(versions) != 1:
            continue
        (version,) = versions
        if version not in weights:
            weights[version] = (
                load_pretrained(tapped.model_dir, dtype=torch.float32, device="cpu")[0].state_dict()
                if version == 0
                else await asyncio.to_thread(load_version, tapped.store, tapped.run, version)
            )
        model.load_state_dict(weights[version], strict=False)
        yield ep, version, model
