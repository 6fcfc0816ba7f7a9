"""`slipstream demo --env swarm` (issue 15): train the orchestrator, then compare swarm and single-agent.

The run itself is the demo's (warm-start, the five-process stack, RL); the swarm adds:

- the plan (`swarm_plan`): the `swarm` env on the search demo's corpus (`SEARCH_OPTIONS`: one
  grep finds an item's document, so a sub-agent takes 2 steps) in the fixed layout with 4 items a
  task and a critical-step budget of 4: a parallel episode (create + assign all, then answer)
  costs 1 + 2 + 1 = 4, a serial one N + 1 = 5, so only a swarm finds every document in budget;
  the search demo's micro preset and warm-start style; the learner's schedule
  `[learner.reward_schedule.parallel]` / `.finish` (λ 0.1 -> 0 over the run's steps); the
  workers' default `[subagents] transport = "local"`, `pin_version = -1` (a frozen copy of the
  first version they load: the warm-start);
- `compare`: after RL, the last version on the held-out split (and on train tasks), in swarm mode
  and in single mode (the same prompts, the direct tools only), the same critical-step budget,
  sampled at the rollout temperature, with the sub-agents on a frozen engine holding the
  warm-start weights; the warm-started model measured the same way ("before");
- the parallelism curve: sub-agents per episode per learner step (`LearnerStep.episode_means`,
  where the learner reports them), with the comparison's train-split figures before and after,
  as a PNG (`swarm.png`), and the whole comparison in `swarm.json` (and `--summary-json`, under
  "swarm").
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import time
from pathlib import Path
from typing import Any

# The comparison: tasks per split and sampled episodes per task (the same tasks for every mode).
COMPARE_TASKS = 24
COMPARE_SAMPLES = 2
FIGURES = ("accuracy", "perf", "critical_steps", "total_steps", "subagents", "finish_rate", "over_budget")


def swarm_plan(search_options: dict[str, Any]) -> dict[str, Any]:
    """ENV_PLANS["swarm"]: see the module docstring."""
    steps = 12
    # λ 0.1 -> 0 over the whole run (exactly 0 from step `steps`, after the last update): over half
    # the steps, seed 1's run stalled at step 6, when λ reached 0, its warm-start never found a
    # document (perf 0 everywhere), and the learner drops groups whose rewards are all equal.
    anneal = {"init": 0.1, "final": 0.0, "anneal_steps": steps, "shape": "linear"}
    return {
        "env_options": {
            "search": dict(search_options),
            # The fixed layout (tasks.py): each question in brief, every prompt line as wide as the
            # assign_task call that carries it, and 4 items, so every byte of an assignment sits one
            # fixed distance after its source (and each id of the answer after its sub-agent's). In
            # the `lines` layout the orchestrator never learned its copies (README, "swarm").
            "layout": "fixed",
            "wide_min": 4,
            "wide_max": 4,
            "max_critical_steps": 4,
            "parallel_cap": 4,
            # The expert is parallel on 80% of tasks and each of its parallel episodes warm-starts
            # the orchestrator's row and one sub-agent's: ~3.6 orchestrator rows in a batch of 8
            # (all sub-agent rows: ~1.3), which the answer's id copies need (see sft_steps).
            "expert_parallel_rate": 0.8,
            "warmstart_subagent_rows": 1,
        },
        "preset": "micro",
        "loss": "cispo",
        # Fixed-distance copies need no copy curriculum. The parallel turn's copies (~600 bytes a
        # row) form early; the answer's (4 ids, each copied from 141 bytes back) late: offline, on
        # 8 answer rows a step, at ~3,800 steps. With ~1.3 such rows a batch (session 14: every
        # sub-agent row kept, half the tasks parallel) 5,000 steps never formed it; with ~3.6
        # (above) the probe (greedy replay of whole parallel expert episodes) stopped the
        # warm-start at 2,750-6,500 steps (libs/envs README, "swarm").
        "sft_steps": 8000,
        "sft_batch": 8,
        "sft_lr": 3e-3,
        "sft_target_accuracy": 0.5,
        "sft_check_every": 250,
        "sft_target_sampled": 0.2,
        # An orchestrator episode samples ~720 bytes (the parallel turn and the padded answer): at
        # T 1 a per-byte slip of 0.2% already loses a quarter of them.
        "temperature": 0.5,
        "max_tokens": 1024,  # an orchestrator turn assigning 4 briefs is ~600 tokens
        "max_seq_len": 2048,
        "lr": 1e-4,
        "group_size": 8,
        "groups_per_step": 4,
        "max_steps": steps,
        "eval_every": 0,
        # The stack's own before/after eval is small: the comparison below is the measurement.
        "heldout_tasks": 8,
        "heldout_samples": 1,
        "train_eval_tasks": 0,
        "reward_schedule": {"parallel": dict(anneal), "finish": dict(anneal)},
        "worker_tasks_in_flight": 8,
        "timeout_s": 1800.0,
    }


async def _compare(plan: Any, model_dir: Path, store_root: Path, run_id: str, emit: Any) -> dict[str, Any]:
    from slipstream.engine import SamplingParams, TorchEngine
    from slipstream.engine.source import ModelSource, load_model
    from slipstream.envs import get_env
    from slipstream.harness.evaluate import evaluate, greedy_params
    from slipstream.store import setup_store
    from slipstream.store.config import StoreConfig
    from slipstream.weights import fetch_version, latest_version, manifest_key

    source = ModelSource(path=str(model_dir), threads=1)
    policy_model, tokenizer = load_model(source)
    frozen_model, _ = load_model(source)
    limit = plan.max_seq_len or None
    policy = TorchEngine(policy_model, tokenizer, max_batch=64, max_seq_len=limit, device="cpu")
    frozen = TorchEngine(frozen_model, tokenizer, max_batch=64, max_seq_len=limit, device="cpu")
    envs = {mode: get_env(plan.env, **{**plan.env_options, "mode": mode}) for mode in ("swarm", "single")}
    tasks = {split: envs["swarm"].generate(split, COMPARE_TASKS, plan.seed + 11) for split in ("heldout", "train")}
    greedy = greedy_params(envs["swarm"])
    sampled = SamplingParams(temperature=plan.temperature, max_tokens=greedy.max_tokens, stop=greedy.stop)
    store = setup_store(StoreConfig(type="local", root=str(store_root)))
    version = latest_version(store, run_id)
    out: dict[str, Any] = {"version": version, "tasks": COMPARE_TASKS, "samples": COMPARE_SAMPLES}
    await policy.start()
    await frozen.start()
    try:
        for stage in ("before", "after"):
            if stage == "after":
                if version is None:
                    break
                manifest, tensors = await asyncio.to_thread(fetch_version, store, manifest_key(run_id, version))
                policy.apply_weights(manifest.policy_version, tensors)
            for mode, env in envs.items():
                for split, ts in tasks.items():
                    t0 = time.monotonic()
                    r = await evaluate(
                        policy,
                        tokenizer,
                        env,
                        ts,
                        samples_per_task=COMPARE_SAMPLES,
                        params=sampled,
                        concurrency=32,
                        frozen_engine=frozen,
                    )
                    row = {"accuracy": r.accuracy, "reward": r.mean_reward, **r.metrics}
                    out[f"{stage}/{mode}/{split}"] = {k: round(float(v), 4) for k, v in row.items()}
                    emit(f"{stage} {mode} {split}: " + _line(row) + f" ({time.monotonic() - t0:.0f} s)")
    finally:
        await policy.stop()
        await frozen.stop()
    return out


def _line(row: dict[str, Any]) -> str:
    return ", ".join(f"{k} {row[k]:.3f}" for k in FIGURES if k in row)


def compare(plan: Any, summary: Any, emit: Any = print) -> dict[str, Any]:
    """Swarm vs single on the last version and the warm-start (see the module docstring)."""
    run_dir = Path(summary.run_dir)
    model_dir = Path(summary.warmstart.get("init_model") or run_dir / "model-init")
    return asyncio.run(_compare(plan, model_dir, run_dir / "data" / "store", run_dir.name, emit))


def parallelism_curve(summary: Any) -> list[dict[str, float]]:
    """Per learner step: sub-agents, critical steps and λ_parallel (where the learner reports them)."""
    rows = []
    for r in summary.steps_log:
        means = r.get("episode_means") or {}
        if not means:
            continue
        rows.append(
            {
                "step": float(r["step"]),
                "subagents": float(means.get("subagents", 0.0)),
                "critical_steps": float(means.get("critical_steps", 0.0)),
                "perf": float(means.get("component.perf", 0.0)),
                "lambda_parallel": float((r.get("reward_weights") or {}).get("parallel", 1.0)),
            }
        )
    return rows


def plot(report: dict[str, Any], path: Path) -> Path:
    """The parallelism curve (sub-agents per episode by learner step) and critical steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    curve = report.get("curve") or []
    steps = report.get("steps", 0)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((ax1, "subagents", "sub-agents per episode"), (ax2, "critical_steps", "critical steps")):
        if curve:
            ax.plot([c["step"] for c in curve], [c[key] for c in curve], marker=".", label="train batches")
        for stage, x in (("before", 0), ("after", steps)):
            for split, marker in (("train", "o"), ("heldout", "s")):
                row = report.get(f"{stage}/swarm/{split}")
                if row and key in row:
                    ax.scatter([x], [row[key]], marker=marker, label=f"{split} eval ({stage})")
        ax.set_xlabel("learner step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    budget = report.get("budget")
    if budget:
        ax2.axhline(budget, color="grey", linestyle="--", label="budget")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(f"slipstream demo --env swarm (seed {report.get('seed', '?')})")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def table(report: dict[str, Any]) -> Any:
    """Swarm vs single, train and held-out, before and after RL: one row per (model, split, mode)."""
    from rich.table import Table

    t = Table(title="swarm vs single (same tasks, same critical-step budget)", title_justify="left")
    short = {"critical_steps": "crit", "total_steps": "total", "subagents": "subs", "finish_rate": "finish"}
    for col in ("model", "split", "mode", *(short.get(k, k) for k in FIGURES)):
        t.add_column(col)
    for stage in ("before", "after"):
        for split in ("train", "heldout"):
            for mode in ("swarm", "single"):
                row = report.get(f"{stage}/{mode}/{split}") or {}
                t.add_row(stage, split, mode, *(f"{row[k]:.3f}" if k in row else "-" for k in FIGURES))
    return t


def run(plan: Any, args: argparse.Namespace) -> int:
    """The swarm demo: the run (with the live view), then the comparison, the table and the plot."""
    import msgspec
    from rich.console import Console

    from slipstream.cli.progress import ProgressView, summary_table
    from slipstream.cli.spec import default_run_dir, restart_policy
    from slipstream.cli.training import run_training

    console = Console(highlight=False, soft_wrap=True)
    plan = copy.deepcopy(plan)
    run_dir = args.run_dir or default_run_dir()
    o = plan.env_options
    console.print(
        f"slipstream demo --env swarm: {plan.max_steps} RL steps, {plan.groups_per_step} groups x {plan.group_size}, "
        f"{o.get('wide_min')}-{o.get('wide_max')} items a task, critical-step budget {o.get('max_critical_steps')}; "
        f"run dir {run_dir}"
    )
    t0 = time.monotonic()
    view = ProgressView(console, plan, live=not args.no_live)
    init = getattr(args, "init_model", None)
    # --init-model: RL (and the comparison) from a saved model, e.g. another seed's warm-start.
    init_model = (init, {"init_model": str(init)}) if init is not None else None
    with view:
        summary = run_training(
            plan,
            run_dir,
            on_event=view.on_event,
            traces=args.traces,
            restart=restart_policy(args),
            init_model=init_model,
        )
    console.print(summary_table(summary))
    report: dict[str, Any] = {
        "seed": plan.seed,
        "steps": summary.steps,
        "budget": o.get("max_critical_steps"),
        "reward_schedule": plan.reward_schedule,
    }
    if summary.ok:
        console.print("comparing swarm and single mode on the warm-start and the last version")
        report.update(compare(plan, summary, emit=lambda m: console.print(f"  {m}")))
        report["curve"] = parallelism_curve(summary)
        console.print(table(report))
        png = plot(report, Path(summary.run_dir) / "swarm.png")
        console.print(f"parallelism curve: {png}")
    report["wall_s"] = round(time.monotonic() - t0, 1)
    out = Path(summary.run_dir) / "swarm.json"
    out.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    if args.summary_json:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        whole = {**msgspec.to_builtins(summary), "swarm": report}
        args.summary_json.write_bytes(msgspec.json.format(msgspec.json.encode(whole)))
    if not summary.ok:
        console.print(f"[red]slipstream demo --env swarm failed:[/red] {summary.error}")
        return 1
    console.print(f"done in {report['wall_s']:.0f} s; swarm.json and summary.json in {summary.run_dir}")
    return 0
