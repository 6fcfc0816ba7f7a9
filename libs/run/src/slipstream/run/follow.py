"""Following a training run from outside: what the bus says, held-out accuracy, and the final accounting.

The run's own services do the work; this watches `learner.step` and `weights.announce`, reads
what the `Tap` (subscribed to `traj.raw.>` and `traj.scored.>` since the server came up) saw
of every trajectory published, evaluates stored versions on held-out tasks in this process, keeps the stack
supervised (a crashed service is restarted; the run fails only when the supervisor gives up),
and at the end reads the streams, the dead letters and the learner's outcome log to account for
every trajectory — including messages published into the streams from outside the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from slipstream.run.heldout import HeldOutScore, held_out
from slipstream.schemas import LearnerStep, WeightAnnounce
from slipstream.schemas.subjects import LEARNER_STEP, WEIGHTS_ANNOUNCE
from slipstream.stack.spec import kind_of

if TYPE_CHECKING:
    from slipstream.run.plan import RunSummary, TrainingPlan
    from slipstream.run.tap import Tap
    from slipstream.stack.local import Stack

Emit = Callable[[str, dict[str, Any]], None]


class RunFailed(RuntimeError):
    """A service ended for good while the run needed it (the supervisor gave up, or --no-restart)."""


# The services that end on their own when the run reaches max_steps; the rest are stopped after.
SELF_ENDING = ("learner", "task-source")
STOP_ORDER = ("task-source", "rollout-worker", "reward-model", "weight-publisher", "learner")


async def follow_run(
    plan: TrainingPlan, stack: Stack, summary: RunSummary, model_dir: Path, emit: Emit, tap: Tap
) -> None:
    from slipstream.bus import connect_bus

    store_root = Path(stack.spec.store.root) if stack.spec.store else None
    bus = await connect_bus(stack.admin_bus(), name="follow")
    try:
        await _follow(plan, stack, summary, model_dir, emit, tap, bus, store_root)
    finally:
        # Closed on every way out (a failed run, an error before the watchers start, a cancelled
        # asyncio.run): a client left open here is a socket collected after its loop has closed.
        await bus.close()


async def _follow(
    plan: TrainingPlan,
    stack: Stack,
    summary: RunSummary,
    model_dir: Path,
    emit: Emit,
    tap: Tap,
    bus: Any,
    store_root: Path | None,
) -> None:
    last_manifest: dict[int, str] = {}
    scored: dict[int, HeldOutScore] = {}  # the versions evals() scored, by version
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
                    "samples_per_episode": s.samples_per_episode,
                    "reward_weights": dict(s.reward_weights),
                    "episode_means": dict(s.episode_means),
                    # the train-inference mismatch, the off-policy mask's share, the KL to the reference (None: none)
                    "mismatch_kl": s.mismatch_kl,
                    "masked_share": s.masked_share,
                    "kl": s.kl,
                    "t": time.monotonic() - t_train,
                }
                summary.steps_log.append(row)
                emit("step", {**row, "spanning": tap.spanning, "tapped": tap.tapped})

    verifier = announce_verifier(stack)

    async def watch_weights() -> None:
        async with bus.subscribe(WEIGHTS_ANNOUNCE, WeightAnnounce, deliver="all") as announces:
            async for d in announces:
                a = d.msg
                if a.run_id != stack.spec.run_id:
                    continue
                # Only the run's publisher's versions count (and get evaluated): a forged announce
                # (no manifest, unsigned, a spoofed token) is checked as the workers check it.
                if verifier is not None and not (await verifier.verify(a)).ok:
                    what = f"ignored an announce of version {a.policy_version} that fails verification"
                    emit("log", {"message": what})
                    continue
                last_manifest[a.policy_version] = a.manifest_key
                summary.final_version = max(summary.final_version, a.policy_version)
                summary.versions_published = len(last_manifest)
                emit("version", {"version": a.policy_version})

    async def watch_processes() -> None:
        # poll_exits restarts crashed services (on this, the main, thread) and reports final exits only.
        while True:
            for name, code in stack.poll_exits():
                if name in SELF_ENDING and code == 0:
                    emit("log", {"message": f"{name} finished"})
                    if name == "learner":
                        done.set()
                        return
                    continue
                if stack.supervisor.state(name) == "retired":  # stopped on purpose (stack.stop_service)
                    emit("log", {"message": f"{name} stopped on purpose (exit {code})"})
                    continue
                raise RunFailed(f"{stack.exit_message(name, code)}:\n{stack.tail(name)}")
            await asyncio.sleep(0.2)

    async def evals() -> None:
        if plan.eval_every <= 0:
            return
        next_at = plan.eval_every
        while not done.is_set():
            await asyncio.sleep(1.0)
            if summary.final_version >= next_at and summary.final_version in last_manifest:
                v = summary.final_version
                score = scored[v] = await held_out(plan, model_dir, store_root, last_manifest[v])
                row = score.row(v)
                summary.eval_curve.append(row)
                emit("eval", row)
                next_at = v + plan.eval_every

    async def watch_stall() -> None:
        # A learner that takes no step for stall_timeout_s will not finish: end training there (the
        # services are stopped below) and evaluate the last version, rather than idle to timeout_s.
        while True:
            await asyncio.sleep(min(5.0, plan.stall_timeout_s / 4))
            last = summary.steps_log[-1]["t"] if summary.steps_log else 0.0
            idle = time.monotonic() - t_train - last
            if idle >= plan.stall_timeout_s:
                step = summary.steps_log[-1]["step"] if summary.steps_log else 0
                summary.stalled_at_step = step
                summary.error = (
                    f"stalled: no learner step for {idle:.0f} s after step {step} of {plan.max_steps} (stall_timeout_s"
                    f" = {plan.stall_timeout_s:.0f}): every group's rewards were equal, or the learner is stuck "
                    "(its log says which); the last version is evaluated as the run's after"
                )
                emit("log", {"message": summary.error})
                return

    async def train() -> None:
        if plan.stall_timeout_s <= 0:
            await watch_processes()
            return
        tasks = [asyncio.create_task(watch_processes()), asyncio.create_task(watch_stall())]
        try:
            finished, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in finished:
            task.result()  # a failed service's RunFailed

    watchers = [asyncio.create_task(c) for c in (watch_steps(), watch_weights(), evals())]
    try:
        try:
            await asyncio.wait_for(train(), timeout=plan.timeout_s)
        except TimeoutError:
            raise RunFailed(
                f"training did not finish within the run's timeout_s = {plan.timeout_s:.0f} s (step "
                f"{summary.steps_log[-1]['step'] if summary.steps_log else 0} of {plan.max_steps}); on a "
                "loaded machine raise timeout_s in the run file"
            ) from None
        summary.train_time_s = time.monotonic() - t_train
        # The publisher announces the learner's last staged version shortly after the learner exits.
        deadline = time.monotonic() + 30
        last_version = summary.steps_log[-1]["version"] if summary.steps_log else 0
        while summary.final_version < last_version and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        statuses = await asyncio.to_thread(worker_statuses, stack)  # one /readyz read per worker
        screen = screen_totals(statuses)
        summary.weight_applies = weight_applies(statuses)
        for worker, rows in summary.weight_applies.items():
            emit("log", {"message": f"{worker} applied {len(rows)} versions: {applies_line(rows)}"})
        for kind in STOP_ORDER:
            # Every process of the kind: with learner ranks, a weight-publisher per rank.
            for name, svc in list(stack.services.items()):
                if kind_of(name) == kind and svc.alive():
                    emit("log", {"message": f"stopping {name}"})
                    await asyncio.to_thread(stack.stop_service, name, stack.spec.drain_timeout_s + 5)
        await asyncio.sleep(0.2)  # let the tap see the last publishes
        await asyncio.to_thread(tap.stop)
        summary.trajectories = await account(bus, summary, stack, tap.injected_scored)
        if screen is not None:
            summary.trajectories["screen"] = screen
        if store_root is not None:
            summary.weights = await asyncio.to_thread(weight_bytes, store_root, stack.spec.run_id)
        summary.spanning_versions = tap.spanning
        emit("phase", {"phase": "eval", "detail": f"held-out accuracy of version {summary.final_version}"})
        known = scored.get(summary.final_version)
        key = last_manifest.get(summary.final_version)
        after = known if known is not None else await held_out(plan, model_dir, store_root, key)
        record_after(summary, after, emit, new=known is None)
    finally:
        for w in watchers:
            w.cancel()
        await asyncio.gather(*watchers, return_exceptions=True)


def record_after(summary: RunSummary, after: HeldOutScore, emit: Emit, *, new: bool = True) -> None:
    """The final version's held-out scores become the summary's "after" figures and its closing eval line.

    One version, one figure: a final version evals() already scored is not sampled again (a second
    sampled evaluation of the same weights gives another figure), and its eval line is printed once
    more, last, so the line just above the summary table shows exactly the table's "after" column.
    """
    summary.heldout_accuracy_after, summary.heldout_reward_after = after.accuracy, after.reward
    summary.heldout_greedy_after = after.greedy
    summary.heldout_invalid_call_rate_after = after.invalid_call_rate
    summary.train_accuracy_after = after.train_accuracy
    summary.train_greedy_after = after.train_greedy
    summary.train_invalid_call_rate_after = after.train_invalid_call_rate
    summary.heldout_tool_calls_after = after.tool_calls
    summary.heldout_metrics_after, summary.train_metrics_after = after.metrics, after.train_metrics
    summary.context_after = after.context
    summary.suites_after = after.suites
    row = after.row(summary.final_version)
    if new:
        summary.eval_curve.append(row)
    emit("eval", row)


def worker_statuses(stack: Stack) -> dict[str, Any]:
    """Each live rollout worker's /readyz body (None where it does not answer), by service name."""
    from slipstream.stack.probe import get_json

    return {
        name: get_json(svc.port, "/readyz", host=svc.host, timeout_s=10.0)
        for name, svc in list(stack.services.items())
        if kind_of(name) == "rollout-worker" and svc.alive()
    }


def screen_totals(statuses: dict[str, Any]) -> dict[str, Any] | None:
    """The rollout workers' task screens (`[worker] screen_target`), summed from their /readyz bodies
    (`worker_statuses`), or None if off."""
    totals: dict[str, Any] = {}
    for body in statuses.values():
        found = _find_key(body, "screen")
        if not isinstance(found, dict):
            continue
        for key in ("kept", "screened", "not_judged"):
            totals[key] = totals.get(key, 0) + int(found.get(key) or 0)
        totals["target"] = found.get("target")
    return totals or None


def weight_applies(statuses: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each rollout worker's per-version apply timings (its /readyz `weight_applies`), by service name."""
    out: dict[str, list[dict[str, Any]]] = {}
    for name, body in statuses.items():
        found = _find_key(body, "weight_applies")
        if isinstance(found, list):
            out[name] = [row for row in found if isinstance(row, dict)]
    return out


def applies_line(rows: list[dict[str, Any]]) -> str:
    """`v1 2310 ms (wait 450), v2 ...`: each version's apply time, and its wait when the engine waits."""
    parts = []
    for row in rows:
        wait = row.get("wait_ms")
        parts.append(f"v{row.get('version')} {row.get('apply_ms')} ms" + ("" if wait is None else f" (wait {wait})"))
    return ", ".join(parts) or "none"


def _find_key(body: Any, key: str) -> Any:
    if isinstance(body, dict):
        if key in body:
            return body[key]
        for value in body.values():
            found = _find_key(value, key)
            if found is not None:
                return found
    return None


def announce_verifier(stack: Stack) -> Any:
    """The workers' announce check (store, signature, signed fence token) for this stack; None off a local store."""
    spec = stack.spec.store
    if spec is None or spec.type != "local":
        return None
    from slipstream.store import LocalObjectStore
    from slipstream.trust import AnnounceVerifier, Keyring

    keyring = Keyring.parse(stack.trusted_keys)
    return AnnounceVerifier(LocalObjectStore(spec.root), run_id=stack.spec.run_id, keyring=keyring)


async def account(
    bus: Any, summary: RunSummary, stack: Stack, injected: Callable[[set[str]], int] | None = None
) -> dict[str, Any]:
    """Every trajectory published, and where it went (streams are work queues: acked = removed).

    Two balances, each stream's own: what entered TRAJ_RAW (the workers' episodes and anything
    published there from outside) was scored, dead-lettered or is still there; what entered
    TRAJ_SCORED (the reward-model's output and anything injected from outside) was settled by the
    learner (trained or dropped with a reason, counted once per stream message however often it
    was redelivered), dead-lettered, or is still there (a settled message whose ack never reached
    the server is still stored: `settled_but_unacked`, counted as settled, not as left).
    `injected(settled_ids)` is how many messages on `traj.scored.>` the tap could not trace to a
    raw trajectory nor the learner settled as one (`TapIds.untraced`).

    The raw balance counts episodes, not scored messages: a reward-model killed (or cut off by a
    nats-server restart) after its scored publish and before its raw ack scores the episode again,
    and a republish the stream's duplicate window no longer covers (a restart forgets the window
    of messages already consumed) is stored twice. The learner's log names both messages under
    one episode id; the second is `republished_scored`, in the scored balance but not the raw one.
    """
    raw = await bus.stream_info("TRAJ_RAW")
    scored = await bus.stream_info("TRAJ_SCORED")
    dead = await bus.dead_letters("TRAJ_RAW", limit=100_000)
    dead_scored = await bus.dead_letters("TRAJ_SCORED", limit=100_000)
    trained = sum(r["trajectories"] for r in summary.steps_log)
    dropped = dict(summary.steps_log[-1]["dropped"]) if summary.steps_log else {}
    settled: int | None = None
    repeats = 0
    unacked = 0
    republished = 0
    settled_ids: set[str] = set()
    tally = outcome_tally(Path(stack.spec.run_dir) / "learner-outcomes.jsonl")
    if tally is not None:
        trained, dropped, settled, repeats = tally.trained, tally.dropped, tally.settled, tally.repeats
        republished, settled_ids = tally.republished, tally.ids
        if tally.sequences and int(scored["messages"]):
            # Settled by the learner but still stored: the ack never reached the server (sent while
            # NATS restarted, or by a learner killed right after its outcome line). The message comes
            # back to a learner as a duplicate; it is counted once, as settled.
            unacked = len(tally.sequences & set(await bus.stored_sequences("TRAJ_SCORED")))
    published = int(raw["last_seq"])
    scored_published = int(scored["last_seq"])
    outside = injected(settled_ids) if injected is not None else 0
    out = {
        "published": published,
        "scored": scored_published - outside - republished,
        "republished_scored": republished,
        "dead_lettered": len(dead),
        "left_unscored": int(raw["messages"]),
        "trained": trained,
        "dropped": dropped,
        "left_in_learner_stream": int(scored["messages"]) - unacked,
        "injected_scored": outside,
        "dead_lettered_scored": len(dead_scored),
        "settled_by_learner": trained + sum(dropped.values()) if settled is None else settled,
        "repeat_deliveries": repeats,
        "settled_but_unacked": unacked,
    }
    # Trained per scored trajectory: the rest were dropped (reasons in `dropped`), their rollouts wasted.
    out["trained_share"] = round(trained / out["scored"], 4) if out["scored"] else 0.0
    out["accounted_raw"] = published == out["scored"] + len(dead) + int(raw["messages"])
    left_scored = out["left_in_learner_stream"]
    out["accounted_scored"] = scored_published == out["settled_by_learner"] + len(dead_scored) + left_scored
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
    tally = outcome_tally(path)
    if tally is None:
        return {}
    return {"trained": tally.trained, **tally.dropped} if tally.trained else dict(tally.dropped)


class OutcomeTally:
    """The learner's outcome log reduced to one outcome per trajectory and a count of stream messages.

    A learner that was killed after writing an outcome but before its acks reached the server
    sees the same messages again: the next learner logs them as `duplicate` (or, for a drop,
    drops them again). Each trajectory therefore counts once, as `trained` if any line says so
    or calls it a `duplicate` (its id is in a committed checkpoint), else as its first drop
    reason; `settled` counts the distinct stream messages the lines name (two messages with the
    same episode id, a republish after the duplicate window, are two) and `repeats` the lines
    beyond one per trajectory. `sequences` are those messages' stream sequence numbers,
    `republished` the messages beyond one per trajectory, and `ids` the trajectories' ids.
    """

    def __init__(self) -> None:
        self.trained = 0
        self.dropped: dict[str, int] = {}
        self.settled = 0
        self.repeats = 0
        self.republished = 0
        self.sequences: set[int] = set()
        self.ids: set[str] = set()


def outcome_tally(path: Path) -> OutcomeTally | None:
    """None when the log does not exist (the learner ran without `[learner] outcomes_path`)."""
    import msgspec

    if not path.exists():
        return None
    final: dict[str, str] = {}
    sequences: dict[str, set[int]] = {}
    lines = 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        row = msgspec.json.decode(line)
        lines += 1
        tid = row["trajectory_id"]
        # `duplicate` means "in a committed checkpoint": trained, by this learner or one before it.
        trained = row["outcome"] == "trained" or row.get("reason") == "duplicate"
        key = "trained" if trained else row.get("reason") or "dropped"
        if tid not in final or (key == "trained" and final[tid] != "trained"):
            final[tid] = key
        sequences.setdefault(tid, set()).update(row.get("sequences") or ())
    tally = OutcomeTally()
    for tid, key in final.items():
        if key == "trained":
            tally.trained += 1
        else:
            tally.dropped[key] = tally.dropped.get(key, 0) + 1
        # An older learner wrote no sequences: one message per trajectory.
        tally.settled += max(1, len(sequences[tid]))
        tally.republished += max(0, len(sequences[tid]) - 1)
        tally.sequences |= sequences[tid]
    tally.repeats = lines - len(final)
    tally.ids = set(final)
    return tally
