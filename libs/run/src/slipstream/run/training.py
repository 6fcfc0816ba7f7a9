"""One training run on a local stack: warm-start, the five-process pipeline, held-out eval, accounting.

`slipstream demo`, `slipstream bench async` and the e2e test all run this: a `TrainingPlan` says
what to train and how big; `run_training` warm-starts the tiny model with a short supervised
phase (so RL starts from a policy that sometimes succeeds), measures held-out accuracy, starts
nats-server, Redis and the services as separate processes (rollout-worker, reward-model, learner,
weight-publisher, task-source), follows the run on the bus until the learner has made its last
step, measures held-out accuracy again on the last published version, and accounts for every
trajectory that was published.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from slipstream.run.heldout import held_out
from slipstream.run.plan import RunSummary, TrainingPlan, engine_conflict, service_env, service_overrides
from slipstream.run.summary_plan import summary_config
from slipstream.runtime.lifecycle import EXIT_DRAIN_TIMEOUT
from slipstream.stack.spec import StackSpec, StoreSpec
from slipstream.stack.supervisor import RestartPolicy

PIPELINE = ("rollout-worker", "reward-model", "learner", "weight-publisher", "task-source")

__all__ = ["PIPELINE", "RunSummary", "TrainingPlan", "run_training", "service_env", "service_overrides"]


def initial_model(
    plan: TrainingPlan, run_dir: Path, on_check: Callable[[int, float, float], None] | None = None
) -> tuple[Path, dict[str, Any]]:
    """Version 0's directory and what making it did: a named model's cache, a model directory as given,
    or a warm-started tiny model
    (`on_check`: see `warm_start`)."""
    if plan.model:
        from slipstream.engine.catalog import CATALOG, ensure_model

        t0 = time.monotonic()
        path = ensure_model(plan.model) if plan.model in CATALOG else Path(plan.model)
        return path, {"model": plan.model, "path": str(path), "resolve_s": round(time.monotonic() - t0, 2)}
    model_dir = run_dir / "model-init"
    from slipstream.run.warmstart import CACHED_ENVS, cached_warm_start

    if plan.env in CACHED_ENVS:  # cached by content hash (warmstart.py)
        return model_dir, cached_warm_start(plan, model_dir, lambda: warm_start(plan, model_dir, on_check=on_check))
    return model_dir, warm_start(plan, model_dir, on_check=on_check)


def _teach_summaries(config: Any) -> Any:
    """`config` with its summary tokens trained (None stays None)."""
    if config is None or getattr(config, "train_summaries", True):
        return config
    return msgspec.structs.replace(config, train_summaries=True)


def warm_start(
    plan: TrainingPlan,
    model_dir: Path,
    summary_modes: list[Any] | None = None,
    on_check: Callable[[int, float, float], None] | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """Build the tiny model on `device`, train it briefly on reference answers, save it as version 0.

    A multi-turn env's expert plays under `summary_modes` (default: the plan's summary config), task
    i under mode i mod n, so one model can be compared under several context modes. `on_check(step,
    greedy, sampled)` hears every probe check of a warm-start with a target (`sft_warmstart`).
    """
    import torch

    from slipstream.engine import build_tiny, save_pretrained
    from slipstream.envs import get_env
    from slipstream.supervised.warmstart import sft_warmstart

    env = get_env(plan.env, **plan.env_options)
    # One thread, like every service: the tiny model's kernels are too small to gain from two,
    # and on a shared machine two threads spin at each barrier (measured on 2 busy cores:
    # 40 supervised steps in 11 s with one thread, 40 s with two).
    torch.set_num_threads(1)
    model, tokenizer = build_tiny(plan.preset, seed=plan.seed)
    model = model.to(device)
    rows = sft_from_rows(plan)
    modes = summary_modes if summary_modes is not None else summary_config(plan)
    # The summary-masking control (train_summaries=False) is an RL ablation: the teacher's summaries
    # are still learned in the warm-start, which every arm shares.
    modes = [_teach_summaries(m) for m in modes] if isinstance(modes, list) else _teach_summaries(modes)
    figures = sft_warmstart(
        model,
        tokenizer,
        env,
        steps=plan.sft_steps,
        batch_size=plan.sft_batch,
        lr=plan.sft_lr,
        seed=plan.seed,
        target_accuracy=plan.sft_target_accuracy,
        check_every=plan.sft_check_every,
        settle_steps=plan.sft_settle_steps,
        sampled_target=plan.sft_target_sampled,
        copy_steps=plan.sft_copy_steps,
        copy_rows=plan.sft_copy_rows,
        drill_rows=plan.sft_drill_rows,
        pool_tasks=plan.sft_pool_tasks,
        temperature=plan.temperature,
        summary=modes,
        on_check=on_check,
        rows=rows,
    )
    save_pretrained(model, tokenizer, model_dir)
    figures.pop("losses", None)
    if rows is not None:
        figures["sft_from"] = plan.sft_from
        figures["sft_set_rows"] = len(rows)
    return figures


def sft_from_rows(plan: TrainingPlan) -> list[Any] | None:
    """The warm-start rows of `plan.sft_from` (a run directory means its learner's SFT export); None without it."""
    if not plan.sft_from:
        return None
    from slipstream.run.plan import SFT_SET
    from slipstream.supervised.sft_set import sft_set_examples

    path = Path(plan.sft_from)
    return sft_set_examples(path / SFT_SET if path.is_dir() else path, env=plan.env)


def earlier_run(run_dir: Path) -> str:
    """What in `run_dir` shows an earlier run (its summary, object store or checkpoints), or ""."""
    for name in ("summary.json", "data", "staging"):
        path = run_dir / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            return name
    return ""


def run_training(
    plan: TrainingPlan,
    run_dir: Path,
    *,
    on_event: Callable[[str, dict[str, Any]], None] | None = None,
    stack_env: dict[str, str] | None = None,
    traces: bool = False,
    extra_services: tuple[str, ...] = (),
    nats_url: str | None = None,
    redis_url: str | None = None,
    store: StoreSpec | None = None,
    restart: RestartPolicy | None = None,
    on_stack: Callable[[Any], None] | None = None,
    on_tap: Callable[[Any], None] | None = None,
    init_model: tuple[Path, dict[str, Any]] | None = None,
    hosts: int = 0,
) -> RunSummary:
    """Run one training end to end; never raises for a failed run (the summary says why).

    `traces` writes each service's spans to run_dir/traces.<service>.jsonl (for `slipstream
    report`); `extra_services` adds services beyond the pipeline (e.g. eval-gate); `nats_url`,
    `redis_url` and `store` reuse existing servers and an object store instead of local ones.
    `restart` is how crashed services are restarted (default: `RestartPolicy()`; `NO_RESTART`
    fails the run at the first death); the summary counts restarts per service. `on_stack` is
    handed the running `Stack` once every service is ready (the tests' and the chaos suite's
    hook: it is called on the main thread and must return at once); `on_tap` is handed the
    trajectory `Tap` as soon as it subscribes (the chaos suite joins its ids with the learner's).
    `init_model` (a saved model's directory and what making it did) replaces the warm-start, so
    runs that compare one thing (e.g. `bench summary`'s two context modes) start from one model.
    `hosts` (>= 3, root only) runs the stack on that many network-namespace hosts with a JetStream
    cluster and Redis with Sentinel (slipstream.stack.multihost).
    """
    from slipstream.run.follow import RunFailed, follow_run

    t0 = time.monotonic()
    emit = on_event or (lambda _kind, _data: None)
    run_dir = run_dir.resolve()
    summary = RunSummary(ok=False, plan=plan, run_dir=str(run_dir))
    if used := earlier_run(run_dir):
        # Its store and checkpoints would be resumed under a fresh warm-start: the learner starts at
        # the old run's last step and, past max_steps, the task source stops before it is ready.
        summary.error = f"run dir {run_dir} already holds a run ({used}): pick another --run-dir or remove it"
        return summary
    if conflict := engine_conflict(plan, {**os.environ, **(stack_env or {})}):
        summary.error = conflict  # before anything starts: no warm-start, no stack
        return summary
    run_dir.mkdir(parents=True, exist_ok=True)
    staging_dir = run_dir / "staging"
    start = f"loading {plan.model}" if plan.model else f"{plan.sft_steps} supervised steps on {plan.env}"
    if not plan.model and plan.sft_target_accuracy > 0:
        target = plan.sft_target_accuracy
        start = f"supervised steps on {plan.env} until greedy train accuracy {target:g}"
        if plan.sft_target_sampled > 0:
            start += f" and expected sampled success {plan.sft_target_sampled:g}"
        start += f" (<= {plan.sft_steps}" + (f" + {plan.sft_settle_steps} settle)" if plan.sft_settle_steps else ")")
    if not plan.model and plan.sft_copy_steps > 0:
        start = f"the copy curriculum (<= {plan.sft_copy_steps} steps), then " + start
    if init_model is not None:
        start = f"none: RL starts from the given model {init_model[0]}"
    emit("phase", {"phase": "warm-start", "detail": start})

    def probe_checked(step: int, greedy: float, sampled: float) -> None:
        emit("warmstart_check", {"step": step, "greedy": greedy, "sampled": sampled})

    if init_model is not None:
        model_dir, summary.warmstart = init_model
    else:
        model_dir, summary.warmstart = initial_model(plan, run_dir, on_check=probe_checked)
    emit("warmstart", summary.warmstart)
    detail = f"held-out accuracy of the initial model ({plan.heldout_tasks} tasks)"
    emit("phase", {"phase": "eval", "detail": detail})
    summary.heldout_tasks = plan.heldout_tasks
    before = asyncio.run(held_out(plan, model_dir, None, None))
    summary.heldout_accuracy_before, summary.heldout_reward_before = before.accuracy, before.reward
    summary.heldout_greedy_before = before.greedy
    summary.heldout_invalid_call_rate_before = before.invalid_call_rate
    summary.train_accuracy_before = before.train_accuracy
    summary.train_greedy_before = before.train_greedy
    summary.train_invalid_call_rate_before = before.train_invalid_call_rate
    summary.heldout_tool_calls_before = before.tool_calls
    summary.heldout_metrics_before, summary.train_metrics_before = before.metrics, before.train_metrics
    summary.context_before = before.context
    summary.suites_before = before.suites
    row = before.row(0)
    summary.eval_curve.append(row)
    emit("eval", row)

    from slipstream.run.tap import Tap, TapError
    from slipstream.stack.local import StackError
    from slipstream.stack.multihost import CLUSTER_TAP, open_stack

    spec = StackSpec(
        run_dir=run_dir,
        services=PIPELINE + tuple(s for s in extra_services if s not in PIPELINE),
        nats_url=nats_url,
        redis_url=redis_url,
        store=store or StoreSpec(type="local", root=str(run_dir / "data" / "store")),
        run_id=run_dir.name,
        env={**service_env(plan, model_dir, staging_dir, run_dir / "learner-outcomes.jsonl"), **(stack_env or {})},
        service_env=service_overrides(plan),
        drain_timeout_s=10.0,
        # A worker with [engine] type = "vllm" is ready once its vLLM server is (minutes on a CPU).
        ready_timeout_s=120.0
        + (float(plan.engine.get("vllm_start_timeout_s", 600.0)) if plan.engine.get("type") == "vllm" else 0.0),
        traces=run_dir / "traces.jsonl" if traces else None,
        tool_services=plan.tool_service_replicas,
        subagent_pool=plan.subagent_pool_replicas,
        pin_version=plan.subagent_pin_version,
        restart=restart or RestartPolicy(),
        hosts=hosts,
    )
    tap: Tap | None = None
    try:
        stack = open_stack(
            spec, log=lambda msg: emit("log", {"message": msg}), on_event=lambda ev: emit("supervisor", ev.as_dict())
        )
    except StackError as exc:  # no namespaces here, say
        summary.error = str(exc)
        summary.wall_time_s = time.monotonic() - t0
        return summary
    try:
        emit("phase", {"phase": "stack", "detail": "starting nats-server, redis and the services"})
        stack.start()
        # At once: the services are still importing, so the tap sees every trajectory ever published.
        tap_options = {**stack.admin_nats_options(), **(CLUSTER_TAP if hosts else {})}
        tap = Tap(stack.servers["nats"].url, tap_options).start()
        if on_tap is not None:
            on_tap(tap)
        stack.write_state()
        stack.wait_ready()
        stack.write_state()
        if on_stack is not None:
            on_stack(stack)
        asyncio.run(follow_run(plan, stack, summary, model_dir, emit, tap))
    except StackError as exc:
        summary.error = f"{exc}\n" + "\n".join(f"--- {k}\n{v}" for k, v in exc.tails.items())
    except (RunFailed, TapError) as exc:  # a service the supervisor gave up on (with its log tail), no tap
        summary.error = str(exc)
    except KeyboardInterrupt:
        summary.error = "interrupted"
    finally:
        if tap is not None:
            tap.stop()
        codes = stack.stop()
        stack.write_state()
        summary.restarts = stack.restarts
        summary.supervisor_events = [e.as_dict() for e in stack.supervisor.events]
        bad, summary.drain_timeouts = stop_errors(codes, finished=summary.steps >= plan.max_steps)
        if bad and not summary.error:
            summary.error = f"services exited with errors: {bad}"
    summary.wall_time_s = time.monotonic() - t0
    summary.ok = not summary.error
    (run_dir / "summary.json").write_bytes(msgspec.json.format(msgspec.json.encode(summary)))
    return summary


def stop_errors(codes: dict[str, int | None], *, finished: bool) -> tuple[dict[str, int], list[str]]:
    """The services' exit codes at the end of a run: (the failures, the drain timeouts forgiven).

    A service that closed with work in flight (exit 3) after the run took all its steps dropped only
    rollouts nobody will train (a sandboxed episode still running when the learner's last step
    landed, say, on a loaded machine): that is named, not a failure. Before the last step, or any
    other non-zero code, it is a failure."""
    bad = {k: v for k, v in codes.items() if v not in (0, None)}
    forgiven = sorted(k for k, v in bad.items() if finished and v == EXIT_DRAIN_TIMEOUT)
    return {k: v for k, v in bad.items() if k not in forgiven}, forgiven
