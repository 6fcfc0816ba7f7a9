"""`slipstream demo --realtime`: the serve -> feedback -> learn -> gate -> promote -> serve loop, measured.

What runs (each service its own process, as in `slipstream demo`; no task-source: the only
traffic is the simulator's):

    simulator (openai client) ─► rollout-worker: [endpoint] on, follow = "promoted", admission
        │  POST /v1/feedback        records calls ─► sessions ─► pending stage (Redis) ─► groups
        └──────────────────────────────────────────► traj.raw.serve (by-reference stubs)
    reward-model: the `serve` env's reward spec (accepted -> 1 / 0) ─► traj.scored.serve
    learner (max_staleness small) ─► weight-publisher ─► weights.announce
    eval-gate: every `steps_per_cycle`-th version on a side eval (held-out `reverse`, greedy)
        ─► weights.promoted ─► the serving worker applies it ─► the simulator is served by it

A *promote cycle* is the time serving ran one promoted version. Per cycle the summary reports the
simulator's acceptance rate (answers served by that version the users accepted), the loop time
(from the first served token of the batch the version was trained on, i.e. the first request of
the earliest session in its learner step, to the serving worker reporting that version), the
staleness of the tokens trained into it (learner version - token version, token by token), the
gate's verdict, and judge/user agreement when a judge scored the episodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from slipstream.run.plan import TrainingPlan
from slipstream.run.realtime_report import Observed, cycle_rows, read_outcomes, summarize
from slipstream.run.sim import FEEDBACK_KEY, SimConfig, SimStats, Simulator

SERVICES = ("rollout-worker", "reward-model", "learner", "weight-publisher", "eval-gate")
MODEL_NAME = "slipstream-tiny"
SETTLE_S = 8.0
"""Seconds of traffic on the last promoted version before the run stops (its cycle's acceptance)."""

Emit = Callable[[str], None]


class RealtimePlan(msgspec.Struct, kw_only=True):
    """One realtime demo; defaults are the CLI's."""

    seed: int = 0
    cycles: int = 4
    """Promote cycles after version 0's (each ends with the gate promoting a trained version)."""
    steps_per_cycle: int = 3
    """Learner steps per cycle: the gate judges every this-many-th version."""
    group_size: int = 8
    groups_per_step: int = 16
    lr: float = 5e-4
    """128 episodes a step at lr 5e-4. Measured offline on seed 0's warm-start (the same learner step,
    weights applied every step, 256 held-out words): word_letters 0.36 -> 0.61 -> 0.73 -> 0.76 ->
    0.82 every 3 steps with sampled correctness flat (0.13-0.14); lr 1e-3 learns faster but greedy
    correctness falls 0.18 -> 0.10, and lr 3e-3 destroys the copy skill (correctness 0.14 -> 0.01)."""
    temperature: float = 0.7
    max_tokens: int = 8
    max_staleness: int = 0
    """Learner staleness bound and the endpoint's admission lag; 0: 2 x steps_per_cycle (a rejected
    candidate leaves one more cycle of training before traffic waits)."""
    sft_steps: int = 400
    sft_target: float = 0.2
    """The default demo's warm-start: greedy train accuracy 0.2 on 3-letter reversals (<= sft_steps)."""
    users: int = 32
    concurrency: int = 16
    preference: str = "word_letters"
    follow_up: float = 0.5
    next_question: float = 0.25
    gate_suite_size: int = 64
    gate_margin: float = 0.1
    judge: str = ""
    """A rubric judge scores `judge_samples` answers of each cycle beside the loop (agreement with the
    users): an OpenAI-compatible base URL, "self" (the serving endpoint's own model) or "smollm2"
    (SmolLM2-135M-Instruct served in-process after the loop); "" = none. Verdicts are prefilled."""
    judge_model: str = ""
    """The model name sent to the judge ("self": the served model's)."""
    judge_samples: int = 16
    session_idle_s: float = 1.0
    feedback_deadline_s: float = 10.0
    timeout_s: float = 900.0

    def staleness(self) -> int:
        return self.max_staleness or 2 * self.steps_per_cycle

    def training_plan(self, base: TrainingPlan) -> TrainingPlan:
        """The TrainingPlan the pipeline services are configured from: `base` (the caller's; `slipstream
        demo --realtime` gives the default demo's reverse plan) with this plan's sizes. `base` is changed."""
        plan = base
        plan.seed = self.seed
        plan.max_steps = self.cycles * self.steps_per_cycle
        plan.group_size = self.group_size
        plan.groups_per_step = self.groups_per_step
        plan.max_staleness = self.staleness()
        plan.lr = self.lr
        plan.temperature = self.temperature
        plan.max_tokens = self.max_tokens
        plan.sft_steps = self.sft_steps
        plan.sft_target_accuracy = self.sft_target
        plan.timeout_s = self.timeout_s
        return plan

    def sim_config(self, base_url: str) -> SimConfig:
        return SimConfig(
            base_url=base_url,
            model=MODEL_NAME,
            seed=self.seed,
            users=self.users,
            concurrency=self.concurrency,
            preference=self.preference,
            follow_up=self.follow_up,
            next_question=self.next_question,
            temperature=self.temperature,
            max_tokens=self.max_tokens,
        )


def reward_spec() -> dict[str, Any]:
    """The `serve` env's reward spec: the user's verdict, nothing else (the preference stays hidden)."""
    return {
        "version": "sim-accepted-v1",
        "components": [{"name": "accepted", "signal": FEEDBACK_KEY, "map": {"true": 1.0, "false": 0.0}}],
    }


def stack_env(rt: RealtimePlan, plan: TrainingPlan, endpoint_port: int) -> dict[str, dict[str, str]]:
    """Per-service variables on top of the plan's `service_env` (`plan`: `rt.training_plan(...)`)."""
    import json

    lag = str(rt.staleness())
    return {
        "rollout-worker": {
            "SLIPSTREAM_WORKER__FOLLOW": "promoted",
            "SLIPSTREAM_ENDPOINT__ENABLED": "true",
            "SLIPSTREAM_ENDPOINT__PORT": str(endpoint_port),
            "SLIPSTREAM_ENDPOINT__RENDERER": "tags",
            "SLIPSTREAM_ENDPOINT__MODEL_NAME": MODEL_NAME,
            "SLIPSTREAM_ENDPOINT__SESSION_IDLE_S": str(rt.session_idle_s),
            "SLIPSTREAM_ENDPOINT__FEEDBACK_DEADLINE_S": str(rt.feedback_deadline_s),
            # Only the users' verdict makes an episode releasable (implicit follow-up signals alone do not).
            "SLIPSTREAM_ENDPOINT__REWARD_KEYS": json.dumps([FEEDBACK_KEY]),
            "SLIPSTREAM_ENDPOINT__GROUP_SIZE": str(rt.group_size),
            "SLIPSTREAM_ENDPOINT__MAX_VERSION_LAG": lag,
            "SLIPSTREAM_ENDPOINT__RETRY_AFTER_S": "0.5",
            "SLIPSTREAM_WORKER__MAX_BATCH": "64",
        },
        "reward-model": {
            "SLIPSTREAM_REWARD__ENV_OPTIONS": json.dumps(
                {"serve": reward_spec(), plan.env: plan.env_options}, separators=(",", ":")
            ),
        },
        "eval-gate": {
            "SLIPSTREAM_GATE__ENVS": json.dumps([plan.env]),
            "SLIPSTREAM_GATE__ENV_OPTIONS": json.dumps({plan.env: plan.env_options}),
            "SLIPSTREAM_GATE__EVERY_N_VERSIONS": str(rt.steps_per_cycle),
            "SLIPSTREAM_GATE__SUITE_SIZE": str(rt.gate_suite_size),
            "SLIPSTREAM_GATE__MIN_SAMPLES": "8",
            "SLIPSTREAM_GATE__MARGIN": str(rt.gate_margin),
            "SLIPSTREAM_GATE__METRIC": "reward",
            # The side eval samples as serving does (the users' temperature), 4 samples a task.
            "SLIPSTREAM_GATE__TEMPERATURE": str(rt.temperature),
            "SLIPSTREAM_GATE__SAMPLES_PER_TASK": "4",
            "SLIPSTREAM_GATE__RETRY_DELAY_S": "1.0",
            # Every due version gets a verdict (one per promote cycle), even when two are waiting.
            "SLIPSTREAM_GATE__SKIP_SUPERSEDED": "false",
        },
    }


class ServingProbe:
    """Polls the serving worker's /readyz: the unix time each policy version was first reported."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.version: int | None = None
        self.first_seen: dict[int, float] = {}

    async def run(self) -> None:
        from slipstream.stack.status import read_json

        while True:
            code, body = await asyncio.to_thread(read_json, self.port, "/readyz", 0.5)
            status = (body or {}).get("status") or {}
            now = time.time()
            if code == 200 and isinstance(status.get("policy_version"), int):
                self.version = int(status["policy_version"])
                self.first_seen.setdefault(self.version, now)
            await asyncio.sleep(0.1)


async def _judge(rt: RealtimePlan, stats: SimStats, seen: Observed, port: int, emit: Emit) -> dict[str, Any]:
    """The side judge's per-version and overall agreement with the users (errors reported, not raised)."""
    from slipstream.run.realtime_judge import LOCAL_JUDGES, judge_cycles, local_judge

    versions = sorted({int(p["policy_version"]) for p in seen.promotions} | {0})

    async def judged(url: str, model: str) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
        emit(f"judging {rt.judge_samples} answers of each of {len(versions)} versions with {model} at {url}")
        return await judge_cycles(stats, versions, url, model, per_cycle=rt.judge_samples, seed=rt.seed)

    try:
        if rt.judge in LOCAL_JUDGES:
            emit(f"starting the {rt.judge} judge in-process")
            async with local_judge(rt.judge) as (url, model):
                per_version, overall = await judged(url, rt.judge_model or model)
        elif rt.judge == "self":
            per_version, overall = await judged(f"http://127.0.0.1:{port}/v1", rt.judge_model or MODEL_NAME)
        else:
            per_version, overall = await judged(rt.judge, rt.judge_model)
    except Exception as exc:  # the loop's figures stand without the judge's
        emit(f"judge failed: {exc!r}")
        return {"error": repr(exc)}
    counts = overall.get("verdicts") or {}
    emit(
        f"judge: {counts.get('scored', 0)} rubric verdicts scored, {counts.get('unscorable', 0)} unscorable "
        f"{counts.get('unscorable_by_reason') or ''}; agreement with the users {overall.get('agreement')}"
    )
    return {"by_version": {str(v): r for v, r in per_version.items()}, **overall}


async def drive(
    rt: RealtimePlan, stack: Any, endpoint_port: int, emit: Emit
) -> tuple[SimStats, Observed, dict[int, float]]:
    """Traffic until `rt.cycles` trained versions were promoted and served (or the learner is done)."""
    from slipstream.bus import connect_bus
    from slipstream.run.follow import RunFailed
    from slipstream.schemas import EvalResult, LearnerStep, WeightsPromoted
    from slipstream.schemas.subjects import EVAL_RESULT, LEARNER_STEP, WEIGHTS_PROMOTED
    from slipstream.stack.status import read_json

    run_id = stack.spec.run_id
    seen = Observed()
    bus = await connect_bus(stack.admin_bus(), name="realtime-demo")
    probe = ServingProbe(stack.services["rollout-worker"].port)

    async def tap(
        subject: str,
        cls: type[Any],
        into: list[dict[str, Any]],
        what: Callable[[Any], str],
        key: Callable[[Any], Any],
    ) -> None:
        # A subscription that fails (the server busy, a reconnect) is made again from the start of
        # the stream; what was already seen is skipped by key, so nothing is counted twice.
        seen_keys: set[Any] = set()
        while True:
            try:
                async for d in bus.subscribe(subject, cls, deliver="all"):
                    if d.msg.run_id == run_id and key(d.msg) not in seen_keys:
                        seen_keys.add(key(d.msg))
                        into.append(msgspec.to_builtins(d.msg))
                        emit(what(d.msg))
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                emit(f"bus subscription to {subject} failed ({exc!r}); subscribing again")
                await asyncio.sleep(1.0)

    def step_line(s: LearnerStep) -> str:
        return f"learner step {s.step} -> v{s.policy_version}: reward {s.reward_mean:.3f}, {s.n_trajectories} episodes"

    def eval_line(e: EvalResult) -> str:
        return f"gate v{e.policy_version}: {e.decision} (score {e.score:.3f}; {e.reason})"

    def promo_line(p: WeightsPromoted) -> str:
        return f"promoted v{p.policy_version} (was v{p.previous_version})"

    jobs = [
        asyncio.create_task(tap(LEARNER_STEP, LearnerStep, seen.steps, step_line, lambda s: s.step)),
        asyncio.create_task(tap(EVAL_RESULT, EvalResult, seen.evals, eval_line, lambda e: e.policy_version)),
        asyncio.create_task(
            tap(
                WEIGHTS_PROMOTED,
                WeightsPromoted,
                seen.promotions,
                promo_line,
                lambda p: (p.policy_version, p.promoted_at),
            )
        ),
        asyncio.create_task(probe.run()),
    ]
    sim = Simulator(rt.sim_config(f"http://127.0.0.1:{endpoint_port}/v1"))
    stop = asyncio.Event()
    traffic: asyncio.Task[Any] | None = None
    last_report = 0.0
    try:
        deadline = time.monotonic() + 120
        while read_json(endpoint_port, "/health", 0.5)[0] != 200:
            if time.monotonic() > deadline:
                raise RunFailed(f"the serving endpoint on port {endpoint_port} never answered /health")
            await asyncio.sleep(0.2)
        emit(f"serving endpoint up on port {endpoint_port}; simulator: {rt.users} users, {rt.concurrency} at once")
        traffic = asyncio.create_task(sim.run_until(stop))
        t0 = time.monotonic()
        learner_done = False
        while True:
            for name, code in stack.poll_exits():
                if name == "learner" and code == 0:
                    learner_done = True
                    emit("learner finished its steps")
                    continue
                raise RunFailed(f"{stack.exit_message(name, code)}:\n{stack.tail(name)}")
            if traffic.done():
                traffic.result()  # raises what ended it
                raise RunFailed("the simulator stopped on its own")
            trained = sorted({int(p["policy_version"]) for p in seen.promotions} - {0})
            goal = rt.cycles * rt.steps_per_cycle
            judged_all = learner_done and any(int(e["policy_version"]) >= goal for e in seen.evals)
            reached = len(trained) >= rt.cycles or goal in trained or judged_all
            current = trained[-1] if trained else 0
            # Done once the last promoted version has served the users for a few seconds.
            if reached and probe.version == current and time.time() - probe.first_seen[current] > SETTLE_S:
                break
            if learner_done and time.time() - max(probe.first_seen.values(), default=time.time()) > 60.0:
                # Nothing new reached serving for a minute after the learner's last step: the gate is done.
                emit("no new version reached serving within 60 s of the learner's last step")
                break
            if time.monotonic() - t0 > rt.timeout_s:
                emit(f"timed out after {rt.timeout_s:.0f} s")
                break
            if time.monotonic() - last_report > 10:
                last_report = time.monotonic()
                acc, n = sim.stats.acceptance(probe.version)
                emit(
                    f"serving v{probe.version}: acceptance {acc:.3f} over {n} answers; "
                    f"{sim.stats.sessions} sessions, {sim.stats.http_429} x 429, {sim.stats.http_5xx} x 5xx"
                )
            await asyncio.sleep(0.2)
    finally:
        stop.set()
        if traffic is not None:
            try:
                await asyncio.wait_for(traffic, 30)
            except (TimeoutError, asyncio.CancelledError):
                traffic.cancel()
            except Exception as exc:  # the run's own error is what matters; keep this one in the log
                emit(f"simulator: {exc!r}")
        await sim.close()
        if rt.judge and sim.stats.turns:
            seen.judge = await _judge(rt, sim.stats, seen, endpoint_port, emit)
        for job in jobs:
            job.cancel()
        await asyncio.gather(*jobs, return_exceptions=True)
        await bus.close()
    return sim.stats, seen, dict(probe.first_seen)


def run_realtime(rt: RealtimePlan, base: TrainingPlan, run_dir: Path, emit: Emit | None = None) -> dict[str, Any]:
    """Warm-start, start the stack, drive traffic, stop, and return the summary (never raises for a failed run).

    `base` is the training plan `rt` sizes (`RealtimePlan.training_plan`): the default demo's reverse plan."""
    from slipstream.run.follow import RunFailed
    from slipstream.run.training import initial_model, service_env
    from slipstream.stack import free_port
    from slipstream.stack.local import Stack, StackError
    from slipstream.stack.spec import StackSpec, StoreSpec

    say = emit or (lambda _m: None)
    t0 = time.monotonic()
    run_dir = run_dir.resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    plan = rt.training_plan(base)
    summary: dict[str, Any] = {"ok": False, "error": "", "run_dir": str(run_dir), "plan": msgspec.to_builtins(rt)}
    say(f"warm-start: supervised steps on reverse until greedy train accuracy {rt.sft_target:g} (<= {rt.sft_steps})")
    model_dir, summary["warmstart"] = initial_model(plan, run_dir)
    say(f"warm-start done: {summary['warmstart'].get('steps')} steps")
    port = free_port()
    env = service_env(plan, model_dir, run_dir / "staging", run_dir / "learner-outcomes.jsonl")
    spec = StackSpec(
        run_dir=run_dir,
        services=SERVICES,
        store=StoreSpec(type="local", root=str(run_dir / "data" / "store")),
        run_id=run_dir.name,
        env=env,
        service_env=stack_env(rt, plan, port),
        drain_timeout_s=10.0,
        ready_timeout_s=240.0,
    )
    stack = Stack(spec, log=say)
    stats: SimStats | None = None
    seen = Observed()
    serving_at: dict[int, float] = {}
    try:
        stack.start()
        stack.write_state()
        stack.wait_ready()
        stack.write_state()
        stats, seen, serving_at = asyncio.run(drive(rt, stack, port, say))
    except (StackError, RunFailed) as exc:
        tails = getattr(exc, "tails", {}) or {}
        summary["error"] = f"{exc}\n" + "\n".join(f"--- {k}\n{v}" for k, v in tails.items())
    except KeyboardInterrupt:
        summary["error"] = "interrupted"
    finally:
        with contextlib.suppress(Exception):
            stack.stop()
            stack.write_state()
    outcomes = read_outcomes(run_dir / "learner-outcomes.jsonl")
    if stats is not None:
        # Every answer as the users saw it (one JSON line each), for later analysis or judging.
        with (run_dir / "sim_turns.jsonl").open("wb") as f:
            for t in stats.turns:
                f.write(msgspec.json.encode(dataclasses.asdict(t)) + b"\n")
        rows = cycle_rows(stats, seen, serving_at, outcomes)
        summary["cycles"] = rows
        summary.update(summarize(rt.preference, stats, rows))
        summary["simulator_errors"] = stats.errors
        summary["trained_episodes"] = sum(1 for o in outcomes if o.get("outcome") == "trained")
        dropped: dict[str, int] = {}
        for o in outcomes:
            if o.get("outcome") != "trained":
                dropped[o.get("reason") or "dropped"] = dropped.get(o.get("reason") or "dropped", 0) + 1
        summary["dropped_episodes"] = dropped
        if seen.judge:
            summary["judge"] = {k: v for k, v in seen.judge.items() if k != "by_version"}
        summary["learner_steps"] = seen.steps
        summary["evals"] = seen.evals
        if rows and len(rows) < rt.cycles + 1 and not summary["error"]:
            summary["error"] = f"only {len(rows) - 1} of {rt.cycles} promote cycles completed"
    summary["wall_time_s"] = round(time.monotonic() - t0, 1)
    summary["ok"] = not summary["error"]
    (run_dir / "realtime.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary
