"""Following a training run from outside: what the bus says, held-out accuracy, and the final accounting.

The run's own services do the work; this watches `learner.step` and `weights.announce`, taps
`traj.raw.>` with a plain (non-JetStream) subscription to see every trajectory as it is
published, evaluates stored versions on held-out tasks in this process, and at the end reads
the streams to account for every trajectory.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.schemas import SCHEMA_HEADER, Episode, LearnerStep, WeightAnnounce, decode_message
from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE

if TYPE_CHECKING:
    from slipstream.cli.stack import Stack
    from slipstream.cli.training import HeldOutScore, RunSummary, TrainingPlan

Emit = Callable[[str, dict[str, Any]], None]
# The services that end on their own when the run reaches max_steps; the rest are stopped after.
SELF_ENDING = ("learner", "task-source")
STOP_ORDER = ("task-source", "rollout-worker", "reward-model", "weight-publisher")


async def held_out(
    plan: TrainingPlan, model_dir: Path, store_root: Path | None, manifest_key: str | None
) -> HeldOutScore:
    """Held-out scores of the initial weights or of a stored version."""
    from slipstream.cli.training import HeldOut

    ev = HeldOut(plan, model_dir)
    await ev.start()
    try:
        if manifest_key and store_root is not None:
            from slipstream.store import setup_store
            from slipstream.store.config import StoreConfig
            from slipstream.weights import fetch_version

            store = setup_store(StoreConfig(type="local", root=str(store_root)))
            manifest, tensors = await asyncio.to_thread(fetch_version, store, manifest_key)
            return await ev.evaluate(manifest.policy_version, tensors)
        return await ev.evaluate()
    finally:
        await ev.stop()


async def follow_run(plan: TrainingPlan, stack: Stack, summary: RunSummary, model_dir: Path, emit: Emit) -> None:
    import nats

    from slipstream.bus import BusConfig, connect_bus

    url = stack.servers["nats"].url
    store_root = Path(stack.spec.store.root) if stack.spec.store else None
    bus = await connect_bus(BusConfig(url=url), name="follow")
    tap = await nats.connect(url, name="follow-tap")
    spanning = 0
    tapped = 0

    async def on_traj(msg: Any) -> None:
        nonlocal spanning, tapped
        tapped += 1
        with contextlib.suppress(Exception):  # a malformed message is the DLQ's business, not ours
            episode = decode_message(msg.data, (msg.headers or {}).get(SCHEMA_HEADER), Episode)
            # An episode (any producer's: a v1 trajectory is upgraded) sampled under more than one version.
            if len({seg.policy_version for s in episode.samples for seg in s.segments}) > 1:
                spanning += 1

    sub = await tap.subscribe("traj.raw.>", cb=on_traj)
    last_manifest: dict[int, str] = {}
    done = asyncio.Event()
    t_train = time.monotonic()

    async def watch_steps() -> None:
        async with bus.subscribe(LEARNER_STEP, LearnerStep, deliver="all") as steps:
            async for d in steps:
                s = d.msg
                if s.run_id != stack.spec.run_id:
                    continue
                summary.steps = max(summary.steps, s.step)
                row = {
                    "step": s.step,
                    "version": s.policy_version,
                    "loss": s.loss,
                    "reward": s.reward_mean,
                    "accuracy": s.accuracy,
                    "trajectories": s.n_trajectories,
                    "staleness": dict(s.staleness),
                    "dropped": dict(s.dropped),
                    "step_time_s": s.step_time_s,
                    "turns_per_episode": s.turns_per_episode,
                    "tool_calls_per_turn": s.tool_calls_per_turn,
                    "invalid_call_rate": s.invalid_call_rate,
                    "t": time.monotonic() - t_train,
                }
                summary.steps_log.append(row)
                emit("step", {**row, "spanning": spanning, "tapped": tapped})

    async def watch_weights() -> None:
        async with bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="all") as announces:
            async for d in announces:
                a = d.msg
                if a.run_id != stack.spec.run_id:
                    continue
                last_manifest[a.policy_version] = a.manifest_key
                summary.final_version = max(summary.final_version, a.policy_version)
                summary.versions_published = len(last_manifest)
                emit("version", {"version": a.policy_version})

    async def watch_processes() -> None:
        while True:
            for name, code in stack.poll_exits():
                if name in SELF_ENDING and code == 0:
                    emit("log", {"message": f"{name} finished"})
                    continue
                raise RuntimeError(f"{name} exited with code {code}:\n{stack.tail(name)}")
            learner = stack.services.get("learner")
            if learner is not None and not learner.alive():
                done.set()
                return
            await asyncio.sleep(0.2)

    async def evals() -> None:
        if plan.eval_every <= 0:
            return
        next_at = plan.eval_every
        while not done.is_set():
            await asyncio.sleep(1.0)
            if summary.final_version >= next_at and summary.final_version in last_manifest:
                v = summary.final_version
                score = await held_out(plan, model_dir, store_root, last_manifest[v])
                row = score.row(v)
                summary.eval_curve.append(row)
                emit("eval", row)
                next_at = v + plan.eval_every

    watchers = [asyncio.create_task(c) for c in (watch_steps(), watch_weights(), evals())]
    try:
        await asyncio.wait_for(watch_processes(), timeout=plan.timeout_s)
        summary.train_time_s = time.monotonic() - t_train
        # The publisher announces the learner's last staged version shortly after the learner exits.
        deadline = time.monotonic() + 30
        last_version = summary.steps_log[-1]["version"] if summary.steps_log else 0
        while summary.final_version < last_version and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for name in STOP_ORDER:
            svc = stack.services.get(name)
            if svc is not None and svc.alive():
                emit("log", {"message": f"stopping {name}"})
                await asyncio.to_thread(svc.process.stop, stack.spec.drain_timeout_s + 5)
        await asyncio.sleep(0.2)  # let the tap see the last publishes
        summary.trajectories = await account(bus, summary, stack)
        if store_root is not None:
            summary.weights = await asyncio.to_thread(weight_bytes, store_root, stack.spec.run_id)
        summary.spanning_versions = spanning
        emit("phase", {"phase": "eval", "detail": f"held-out accuracy of version {summary.final_version}"})
        key = last_manifest.get(summary.final_version)
        after = await held_out(plan, model_dir, store_root, key)
        summary.heldout_accuracy_after, summary.heldout_reward_after = after.accuracy, after.reward
        summary.heldout_greedy_after = after.greedy
        summary.heldout_invalid_call_rate_after = after.invalid_call_rate
        summary.train_accuracy_after = after.train_accuracy
        summary.train_greedy_after = after.train_greedy
        summary.eval_curve.append(after.row(summary.final_version))
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)
        await sub.unsubscribe()
        await tap.close()
        await bus.close()


async def account(bus: Any, summary: RunSummary, stack: Stack) -> dict[str, Any]:
    """Every trajectory published, and where it went (streams are work queues: acked = removed)."""
    raw = await bus.stream_info("TRAJ_RAW")
    scored = await bus.stream_info("TRAJ_SCORED")
    dead = await bus.dead_letters("TRAJ_RAW", limit=10_000)
    trained = sum(r["trajectories"] for r in summary.steps_log)
    dropped = dict(summary.steps_log[-1]["dropped"]) if summary.steps_log else {}
    outcomes = outcome_counts(Path(stack.spec.run_dir) / "learner-outcomes.jsonl")
    if outcomes:
        trained = outcomes.pop("trained", 0)
        dropped = outcomes
    published = int(raw["last_seq"])
    scored_published = int(scored["last_seq"])
    out = {
        "published": published,
        "scored": scored_published,
        "dead_lettered": len(dead),
        "left_unscored": int(raw["messages"]),
        "trained": trained,
        "dropped": dropped,
        "left_in_learner_stream": int(scored["messages"]),
    }
    out["accounted_raw"] = published == scored_published + len(dead) + int(raw["messages"])
    out["accounted_scored"] = scored_published == trained + sum(dropped.values()) + int(scored["messages"])
    return out


def weight_bytes(store_root: Path, run_id: str) -> dict[str, Any]:
    """Bytes the weight-publisher stored per version (deltas and keyframes) against full snapshots."""
    from slipstream.store import setup_store
    from slipstream.store.config import StoreConfig
    from slipstream.weights import read_manifest

    store = setup_store(StoreConfig(type="local", root=str(store_root)))
    manifests = [read_manifest(store, k) for k in store.list(f"weights/{run_id}/") if k.endswith("/manifest.json")]
    stored = sum(m.stored_bytes for m in manifests)
    raw = sum(m.raw_bytes for m in manifests)
    return {
        "versions": len(manifests),
        "keyframes": sum(1 for m in manifests if m.keyframe),
        "stored_bytes": stored,
        "full_snapshot_bytes": raw,
        "stored_fraction": stored / raw if raw else 0.0,
        "delta_stored_fraction": (
            sum(m.stored_bytes for m in manifests if not m.keyframe)
            / max(1, sum(m.raw_bytes for m in manifests if not m.keyframe))
        ),
    }


def outcome_counts(path: Path) -> dict[str, int]:
    """trained / dropped-by-reason counts from the learner's outcome log (one JSON line per trajectory)."""
    import msgspec

    if not path.exists():
        return {}
    counts: dict[str, int] = {}
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        row = msgspec.json.decode(line)
        key = "trained" if row["outcome"] == "trained" else row.get("reason") or "dropped"
        counts[key] = counts.get(key, 0) + 1
    return counts
