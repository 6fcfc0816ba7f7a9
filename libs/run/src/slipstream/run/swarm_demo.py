"""`slipstream demo --env swarm` (issues 15, 32): the swarm against a single agent trained in its own right.

Each arm is a run of the demo's own (warm-start, the five-process stack, RL) with one plan:

- the plan (examples/swarm.toml): the `swarm` env on the first search demo's corpus (one-hop: one
  grep finds an item's document, so a sub-agent takes 2 steps) in the brief layout, N in {2, 4,
  8} items a task, held-out tasks of unseen items (`heldout_items = "unseen"`), a critical-step
  budget of 4 (train tasks draw theirs from `train_budgets`, so serial teacher episodes run several
  turns; every evaluation is at 4); the teacher knows the swarm tools but works serially with one sub-agent per item
  on ~95% of the tasks (`expert_subagents = "per_item"`, `expert_parallel_rate` 0.05; the orchestrator
  refers to items by number and to results by sub-agent name, `by_reference`); the micro
  preset and the search demo's warm-start style; the learner's schedule
  `[learner.reward_schedule.parallel]` / `.finish` (λ 0.1 -> 0 over the run's steps); the
  workers' sub-agents on a frozen copy of the warm-start (`[subagents] pin_version = -1`), or with
  `--swarm-pool R` on R replicas of the sub-agent pool pinned to it (the report's `subagents_on`);
- the arms (`--swarm-arm`): `single` (mode single: the direct search tools only, the `[single]`
  prompt, its own serial teacher and warm-start, the same RL steps, episodes a step and budget;
  the episodes each arm sampled to fill them, uniform groups dropped, are in its `stack.samples`) and
  `swarm`, one after the other (`both`, the default), each in RUN_DIR/<arm>; `--swarm-lambda 0`
  runs the swarm with λ = 0 (the ablation, RUN_DIR/swarm-lambda0); warm-starts are cached by
  content hash (`warmstart`), so a second run of an arm with the same plan and code skips it;
- each arm's evaluation (swarm_eval.py): its warm-start ("before") and last version ("after"),
  in its own mode, on the same held-out and train items, sampled at the rollout temperature:
  accuracy, critical steps, sub-agents and parallel rate per episode (the warm-start's
  held-out parallel rate is the one measured before RL), wall-clock latency per episode; plus the
  stack's own held-out evaluation's latency (the eval-gate path, sub-agents pinned) and its RL
  rollouts' over the first and last steps (`stack.rollouts_latency_s`: on the pool with `--swarm-pool`);
- the swarm arm's ceiling (swarm_eval `ceiling`): the teacher's orchestrator, parallel on every
  task, over the arm's frozen sub-agents on the same items: the accuracy RL on the orchestrator
  could reach at most, since the sub-agents it trains with are not trained (rows `ceiling/...`;
  with `--swarm-budget-model`, swarm-ceiling.json);
- the accuracy-vs-budget curve (B = 2 .. N + 2 at N = 4 and 8) of each arm's last version:
  `swarm-budget.json` and `swarm-budget.png`; `--swarm-budget-model DIR` draws it for any saved
  model alone;
- the parallelism curve of the swarm arm: sub-agents per episode per learner step
  (`LearnerStep.episode_means`) with its evaluations before and after, `swarm.png`; everything in
  `swarm.json` (and `--summary-json`, under "swarm").
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream.run.swarm_eval import ArmModel, budget_curve, ceiling, evaluate_arm, plot_budget
from slipstream.run.swarm_report import ARMS, _close, _report_head, parallelism_curve, plot, table

__all__ = ["arm_name", "arm_plan", "parallelism_curve", "plot", "rl_plan", "run", "table"]  # plot, table: re-exported

# Each arm's evaluation: tasks per split and sampled episodes per task (the same items for every arm).
COMPARE_TASKS = 24
COMPARE_SAMPLES = 2
# The accuracy-vs-budget curve: held-out tasks per (N, B) point, one sample each.
BUDGET_TASKS = 16
BUDGET_NS = (4, 8)
ITEM_COUNTS = (2, 4, 8)
LAMBDA = 0.1
LATENCY_WINDOW = 10  # learner steps averaged at each end of the rollouts' latency


def arm_plan(plan: Any, arm: str, lam: float | None = None) -> Any:
    """`plan` for one arm: "swarm" (as planned) or "single" (the single agent in its own right: mode
    single, so its own prompt, teacher and warm-start, with the same steps, episodes a step and budget);
    `lam` (None: as planned) sets λ of r_parallel and r_finish, annealed from `lam` to 0 over the
    run, or 0 throughout (the ablation)."""
    if arm not in ARMS:
        raise ValueError(f"swarm arm must be one of {ARMS}, got {arm!r}")
    plan = copy.deepcopy(plan)
    plan.env_options = {**plan.env_options, "mode": arm}
    if lam is not None:
        if lam < 0:
            raise ValueError(f"--swarm-lambda must be >= 0, got {lam}")
        steps = plan.max_steps
        plan.reward_schedule = {
            name: {"init": lam, "final": 0.0, "anneal_steps": max(1, steps), "shape": "linear"}
            for name in ("parallel", "finish")
        }
    return plan


def arm_name(arm: str, lam: float | None) -> str:
    """The arm's directory and report key: `swarm`, `single`, or e.g. `swarm-lambda0`."""
    return arm if lam is None else f"{arm}-lambda{lam:g}"


def add_arguments(p: Any) -> None:
    """`slipstream demo --env swarm`'s own flags."""
    g = p.add_argument_group("--env swarm: the swarm against a single agent trained in its own right (issue 32)")
    g.add_argument(
        "--swarm-arm",
        choices=("both", *ARMS),
        default="both",
        help="train the single agent, then the swarm, each from its own warm-start (both, the default), or one arm",
    )
    g.add_argument(
        "--swarm-lambda",
        type=float,
        default=None,
        metavar="L",
        help=f"λ of r_parallel and r_finish, annealed L -> 0 over the run (default {LAMBDA}; 0: the ablation)",
    )
    g.add_argument(
        "--swarm-items",
        default=None,
        metavar="N,N,...",
        help=f"item counts of the tasks (default {','.join(map(str, ITEM_COUNTS))})",
    )
    g.add_argument(
        "--swarm-rl-budgets",
        default=None,
        metavar="B,B,...",
        help="critical-step budgets the RL rollouts' train tasks draw from (default: the plan's train_budgets, "
        "those of the warm-start's teacher, which keeps them either way); e.g. 4: RL at the evaluations' budget",
    )
    g.add_argument(
        "--swarm-compare-tasks",
        type=int,
        default=COMPARE_TASKS,
        metavar="T",
        help=f"held-out and train tasks of each arm's evaluation (default {COMPARE_TASKS}, x{COMPARE_SAMPLES} samples)",
    )
    g.add_argument(
        "--swarm-budget-tasks",
        type=int,
        default=BUDGET_TASKS,
        metavar="T",
        help=f"held-out tasks per point of the accuracy-vs-budget curve (default {BUDGET_TASKS}; 0: no curve)",
    )
    g.add_argument(
        "--swarm-budget-ns",
        default=",".join(map(str, BUDGET_NS)),
        metavar="N,N",
        help="item counts of the accuracy-vs-budget curve (B = 2 .. N + 2)",
    )
    g.add_argument(
        "--swarm-budget-model",
        type=Path,
        default=None,
        metavar="DIR",
        help="only the accuracy-vs-budget curve of this saved model (mode: --swarm-arm, swarm unless single), "
        "written to --run-dir as swarm-budget.json/png (and, for the swarm, its ceiling: swarm-ceiling.json; "
        "with --swarm-budget-tasks 0 the ceiling alone)",
    )
    g.add_argument(
        "--swarm-evaluate-run",
        type=Path,
        default=None,
        metavar="DIR",
        help="no training: evaluate a run whose RL was stopped (by hand, or its process killed) before its own "
        "evaluation: DIR is its --run-dir, --swarm-arm and --swarm-lambda as it ran, --init-model its warm-start; "
        "writes DIR/swarm.json as the run would have, with the step it stopped at",
    )
    g.add_argument(
        "--swarm-pool",
        type=int,
        default=0,
        metavar="R",
        help="the swarm arm's sub-agents on R replicas of the pinned sub-agent pool (its own processes, over "
        "NATS) instead of a frozen engine in each worker (default 0); the rollouts' latency per episode is then "
        "the pool's",
    )


def _ints(text: str, flag: str, what: str = "item counts", top: int = 26) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"slipstream demo: {flag} takes {what} like 2,4,8, got {text!r}") from None
    if not values or any(not 1 <= v <= top for v in values):
        raise SystemExit(f"slipstream demo: {flag} takes {what} in 1..{top}, got {text!r}")
    return values


def rl_plan(plan: Any, budgets: list[int] | None) -> Any:
    """The plan the arm's RL runs: `plan` with its train tasks' budgets drawn from `budgets` (None: as
    planned). The warm-start keeps `plan` (its teacher needs the longer budgets to show several
    sub-agents over several turns) and every evaluation is at max_critical_steps either way."""
    if budgets is None:
        return plan
    plan = copy.deepcopy(plan)
    plan.env_options = {**plan.env_options, "train_budgets": list(budgets)}
    return plan


def warm_started(plan: Any, model_dir: Path, say: Any = None) -> dict[str, Any]:
    """The arm's warm-start, cached by the content hash of its plan and code (warmstart.py);
    `say(line)` hears each probe check (a cold warm-start runs for tens of minutes)."""
    from slipstream.run.training import warm_start
    from slipstream.run.warmstart import cached_warm_start

    t0 = time.monotonic()

    def checked(step: int, greedy: float, sampled: float) -> None:
        if say is not None:
            say(
                f"  warm-start step {step}: probe greedy {greedy:.3f} (target {plan.sft_target_accuracy:g}), "
                f"sampled {sampled:.3f} (target {plan.sft_target_sampled:g}), {time.monotonic() - t0:.0f} s"
            )

    figures = cached_warm_start(plan, model_dir, lambda: warm_start(plan, model_dir, on_check=checked))
    return {**figures, "init_model": str(model_dir), "warmstart_wall_s": round(time.monotonic() - t0, 1)}


def stack_figures(summary: Any) -> dict[str, Any]:
    """What the running stack measured: its held-out eval before and after (the eval path the
    gate uses, sub-agents pinned), latency per episode included, and the warm-start's figures."""
    keep = ("accuracy", "perf", "critical_steps", "subagents", "parallel_rate", "latency_s", "over_budget")

    def pick(m: dict[str, Any]) -> dict[str, float]:
        return {k: round(float(m[k]), 4) for k in keep if k in m}

    tr = summary.trajectories or {}
    return {
        "heldout_before": pick(summary.heldout_metrics_before),
        "heldout_after": pick(summary.heldout_metrics_after),
        "rollouts_latency_s": rollouts_latency(summary.steps_log),
        "warmstart": {k: v for k, v in summary.warmstart.items() if isinstance(v, (int, float, str))},
        "steps": summary.steps,
        # The samples the arm's RL drew: every step trains the same number of episodes, but a group
        # whose rewards are all equal is dropped, so an arm with many such groups samples more.
        "samples": {
            "sampled": tr.get("published", 0),
            "trained": tr.get("trained", 0),
            "dropped": dict(tr.get("dropped") or {}),
        },
        "wall_time_s": round(summary.wall_time_s, 1),
    }


def rollouts_latency(steps_log: list[dict[str, Any]], window: int = LATENCY_WINDOW) -> dict[str, Any]:
    """Seconds per episode of the RL rollouts in the running stack (the learner's per-step mean of the
    env's `wall_ms`: the orchestrator's turns and its sub-agents, on the pool where the run has one),
    over the first and the last `window` steps; {} where the learner reported none."""
    per_step = [
        float(r["episode_means"]["wall_ms"]) / 1000 for r in steps_log if "wall_ms" in (r.get("episode_means") or {})
    ]
    if not per_step:
        return {}
    return {
        "first": round(statistics.fmean(per_step[:window]), 3),
        "last": round(statistics.fmean(per_step[-window:]), 3),
        "window": window,
        "steps": len(per_step),
    }


def _budget_only(plan: Any, args: argparse.Namespace, console: Any) -> int:
    from slipstream.stack.spec import default_run_dir

    arm = "single" if args.swarm_arm == "single" else "swarm"
    p = arm_plan(plan, arm)
    run_dir = args.run_dir or default_run_dir()
    model = ArmModel(mode=arm, env_options=p.env_options, model_dir=args.swarm_budget_model)
    if arm == "single" and args.swarm_budget_tasks <= 0:
        console.print("slipstream demo --env swarm: --swarm-budget-tasks 0 leaves the single arm nothing to measure")
        return 2
    run_dir.mkdir(parents=True, exist_ok=True)
    if args.swarm_budget_tasks > 0:  # 0: the ceiling alone
        curve = budget_curve(
            model,
            p,
            ns=_ints(args.swarm_budget_ns, "--swarm-budget-ns"),
            tasks=args.swarm_budget_tasks,
            seed=p.seed + 13,
            last=False,
            emit=lambda m: console.print(f"  {m}"),
        )
        curve["model"] = str(args.swarm_budget_model)
        (run_dir / "swarm-budget.json").write_text(json.dumps({arm: curve}, indent=1))
        png = plot_budget({arm: curve}, run_dir / "swarm-budget.png")
        console.print(f"accuracy vs budget: {run_dir / 'swarm-budget.json'}, {png}")
    if arm == "swarm":  # what this model's sub-agents allow, under the teacher's parallel orchestrator
        top = ceiling(
            model, p, tasks=args.swarm_compare_tasks, samples=COMPARE_SAMPLES, seed=p.seed + 11, emit=console.print
        )
        top["model"] = str(args.swarm_budget_model)
        (run_dir / "swarm-ceiling.json").write_text(json.dumps(top, indent=1))
        console.print(f"ceiling: {run_dir / 'swarm-ceiling.json'}")
    return 0


def evaluate_entry(
    arm: str,
    name: str,
    p: Any,
    arm_dir: Path,
    init_dir: Path,
    args: argparse.Namespace,
    report: dict[str, Any],
    console: Any,
) -> dict[str, Any] | None:
    """One arm's evaluation after its RL, into `report`: its warm-start (`init_dir`) and the last
    version stored in `arm_dir`, in its own mode, on the same held-out and train items; for the
    swarm its ceiling; returns its accuracy-vs-budget curve (None with --swarm-budget-tasks 0)."""
    entry = report[name]
    model = ArmModel(
        mode=arm,
        env_options=p.env_options,
        model_dir=init_dir,
        store_root=arm_dir / "data" / "store",
        run_id=arm_dir.name,
    )
    console.print(f"evaluating {name}: its warm-start and last version, in {arm} mode")

    def emit(message: str) -> None:
        console.print(f"  {message}")

    n = args.swarm_compare_tasks  # the evaluation and the ceiling: the same items (seed + 11)
    ev = evaluate_arm(model, p, tasks=n, samples=COMPARE_SAMPLES, seed=p.seed + 11, emit=emit)
    entry["version"] = ev.get("version")
    for key, row in ev.items():
        if "/" in key:
            stage, split = key.split("/")
            report[f"{stage}/{name}/{split}"] = row
    if arm == "swarm":
        # the teacher's orchestrator in parallel over these frozen sub-agents, on the same tasks:
        # the accuracy RL on the orchestrator could reach at most
        top = ceiling(model, p, tasks=n, samples=COMPARE_SAMPLES, seed=p.seed + 11, emit=emit)
        for split in ("heldout", "train"):
            report[f"ceiling/{name}/{split}"] = top[split]
    if args.swarm_budget_tasks <= 0:
        return None
    console.print(f"accuracy vs critical-step budget, {name}")
    ns = _ints(args.swarm_budget_ns, "--swarm-budget-ns")
    return budget_curve(model, p, ns=ns, tasks=args.swarm_budget_tasks, seed=p.seed + 13, emit=emit)


def learner_steps(arm_dir: Path) -> list[dict[str, Any]]:
    """The learner's step rows from its log, in steps_log's shape: the steps_log of a run not followed to its end."""
    from slipstream.run.report import read_logs, steps_from_logs

    logs, _ = read_logs(arm_dir / "logs")  # lines cut by a kill are skipped
    rows = [r for stem, lines in logs.items() if stem.startswith("learner") for r in lines]
    last = {s["step"]: s for s in steps_from_logs(rows)}  # a resumed learner logs a step once more
    return [last[k] for k in sorted(last)]


def _evaluate_stopped(plan: Any, args: argparse.Namespace, rl_budgets: list[int] | None, console: Any) -> int:
    """--swarm-evaluate-run: the evaluation a run would have made after its RL, for a run stopped before it."""
    from types import SimpleNamespace

    arm = args.swarm_arm
    lam = getattr(args, "swarm_lambda", None)
    given = getattr(args, "init_model", None)
    if arm not in ARMS or given is None:
        console.print(
            "slipstream demo --env swarm: --swarm-evaluate-run needs the arm it ran (--swarm-arm swarm or single) "
            "and its warm-start (--init-model DIR)"
        )
        return 2
    name = arm_name(arm, lam if arm == "swarm" else None)
    run_dir = args.swarm_evaluate_run.resolve()
    arm_dir = run_dir / name
    steps = learner_steps(arm_dir)
    if not (arm_dir / "data" / "store").is_dir() or not steps:
        console.print(
            f"slipstream demo --env swarm: {arm_dir} holds no stored versions or learner steps: not a run of "
            f"--swarm-arm {arm}{'' if lam is None else f' --swarm-lambda {lam:g}'} (its --run-dir is {run_dir}?)"
        )
        return 2
    t0 = time.monotonic()
    p = arm_plan(plan, arm, lam if arm == "swarm" else None)
    report = _report_head(plan, rl_budgets)
    stopped = int(steps[-1]["step"])
    report[name] = {"run_dir": str(arm_dir), "ok": False, "rl_stopped_at_step": stopped}
    report["arms"].append(name)
    console.print(f"{name}: RL stopped at step {stopped} of {plan.max_steps}; evaluating its last version")
    curves: dict[str, dict[str, Any]] = {}
    curve = evaluate_entry(arm, name, p, arm_dir, Path(given).resolve(), args, report, console)
    if curve is not None:
        curves[name] = curve
    if arm == "swarm":
        report["curve"] = parallelism_curve(SimpleNamespace(steps_log=steps))
        report["reward_schedule"] = p.reward_schedule
    return _close(report, curves, run_dir, "", args, console, t0)


def run(plan: Any, args: argparse.Namespace) -> int:
    """The swarm demo: each arm's run (with the live view) and evaluation, then the table and the plots."""
    from rich.console import Console

    from slipstream.run.progress import ProgressView, summary_table
    from slipstream.run.training import run_training
    from slipstream.run.warmstart import given_model
    from slipstream.stack.spec import default_run_dir, restart_policy

    console = Console(highlight=False, soft_wrap=True)
    plan = copy.deepcopy(plan)
    if getattr(args, "swarm_items", None):
        counts = _ints(args.swarm_items, "--swarm-items")
        plan.env_options = {
            **plan.env_options,
            "item_counts": counts,
            "max_subagents": max(counts),
            "max_assign_per_turn": max(counts),
        }
    pool = getattr(args, "swarm_pool", 0) or 0
    if pool < 0:
        console.print(f"slipstream demo --env swarm: --swarm-pool must be >= 0 replicas, got {pool}")
        return 2
    rl_budgets = getattr(args, "swarm_rl_budgets", None)
    rl_budgets = _ints(rl_budgets, "--swarm-rl-budgets", "critical-step budgets", 1024) if rl_budgets else None
    if plan.sft_target_accuracy <= 0:
        plan.sft_target_sampled = 0.0  # --sft-target 0: no probe, so no sampled condition of its stop
    if getattr(args, "swarm_budget_model", None) is not None:
        return _budget_only(plan, args, console)
    if getattr(args, "swarm_evaluate_run", None) is not None:
        return _evaluate_stopped(plan, args, rl_budgets, console)
    lam = getattr(args, "swarm_lambda", None)
    chosen = getattr(args, "swarm_arm", "both")
    arms = ["single", "swarm"] if chosen == "both" else [chosen]
    given = getattr(args, "init_model", None)
    if given is not None:
        # Each arm has its own warm-start (its own prompt and teacher): one given model starts one arm.
        if len(arms) != 1:
            console.print("slipstream demo --env swarm: --init-model starts one arm: add --swarm-arm swarm or single")
            return 2
        if not (Path(given) / "config.json").is_file():
            console.print(f"slipstream demo --env swarm: --init-model {given} is not a saved model (no config.json)")
            return 2
    run_dir = (args.run_dir or default_run_dir()).resolve()
    o = plan.env_options
    console.print(
        f"slipstream demo --env swarm: arms {', '.join(arms)}; {plan.max_steps} RL steps each, "
        f"{plan.groups_per_step} groups x {plan.group_size}, N in {o.get('item_counts')} items a task, "
        f"critical-step budget {o.get('max_critical_steps')} (RL's train tasks: "
        f"{rl_budgets or o.get('train_budgets') or o.get('max_critical_steps')}), "
        f"λ {lam if lam is not None else LAMBDA} -> 0; run dir {run_dir}"
    )
    t0 = time.monotonic()
    report = _report_head(plan, rl_budgets)
    curves: dict[str, dict[str, Any]] = {}
    failed = ""
    summaries: dict[str, Any] = {}
    for arm in arms:
        name = arm_name(arm, lam if arm == "swarm" else None)
        p = arm_plan(plan, arm, lam if arm == "swarm" else None)
        if arm == "swarm" and pool:
            p.subagent_pool_replicas = pool  # pinned to version 0, the warm-start: frozen as in the worker
        arm_dir = run_dir / name
        arm_dir.mkdir(parents=True, exist_ok=True)
        a0 = time.monotonic()
        init_dir = Path(given).resolve() if given is not None else arm_dir / "model-init"
        if given is not None:
            console.print(f"[bold]{name}[/bold]: RL from the given model {given} (no warm-start)")
            init, why = given_model(init_dir)
            init["warmstart_wall_s"] = 0.0
            if why:
                console.print(f"  note: {why}")
        else:
            console.print(f"[bold]{name}[/bold]: warm-start (cached by content hash) in {arm_dir / 'model-init'}")
            init = warm_started(p, init_dir, say=console.print)
            console.print(
                f"  warm-start: {init.get('steps', '?')} steps, {init['warmstart_wall_s']:.0f} s"
                + (" (cached)" if init.get("cached") else "")
            )
        p_rl = rl_plan(p, rl_budgets)
        view = ProgressView(console, p_rl, live=not args.no_live)
        with view:
            summary = run_training(
                p_rl,
                arm_dir,
                on_event=view.on_event,
                traces=args.traces,
                restart=restart_policy(args),
                init_model=(init_dir, init),
            )
        summaries[name] = summary
        console.print(summary_table(summary))
        entry: dict[str, Any] = {
            "run_dir": str(arm_dir),
            "stack": stack_figures(summary),
            "ok": summary.ok,
            "subagents_on": "none" if arm == "single" else f"pool x{pool}" if pool else "worker (frozen engine)",
        }
        report[name] = entry
        report["arms"].append(name)
        stopped = not summary.ok
        if stopped:
            failed = f"{name}: {summary.error}"
            entry["wall_s"] = round(time.monotonic() - a0, 1)
            if not summary.steps:
                break
            # RL stopped part-way (timeout_s, a service given up on): its versions are stored, so
            # evaluate the last one as the run's after, marked, rather than lose the run.
            entry["rl_stopped_at_step"] = summary.steps
            console.print(
                f"{name}: RL stopped at step {summary.steps} of {plan.max_steps}; evaluating its last version"
            )
        curve = evaluate_entry(arm, name, p, arm_dir, init_dir, args, report, console)
        if curve is not None:
            curves[name] = curve
        if arm == "swarm":
            report["curve"] = parallelism_curve(summary)
            report["reward_schedule"] = p.reward_schedule
        if stopped:
            break
        entry["wall_s"] = round(time.monotonic() - a0, 1)
        console.print(f"{name} done in {entry['wall_s']:.0f} s")
    return _close(report, curves, run_dir, failed, args, console, t0, summaries)
