"""The swarm demo's report (issue 32): the swarm arm's parallelism curve by learner step and its plot,
the before/after/ceiling table, and swarm.json's first keys and closing figures (`_close`: the
table printed, the budget and parallelism plots drawn, swarm.json and --summary-json written).
`swarm_demo` runs the arms and evaluates them; this module only presents what they measured.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from slipstream.run.report_figure import save
from slipstream.run.swarm_eval import FIGURES, plot_budget

ARMS = ("swarm", "single")


def parallelism_curve(summary: Any) -> list[dict[str, float]]:
    """Per learner step: sub-agents, parallel turns (turns that ran 2+ sub-agents at once) and critical
    steps per episode, perf, λ_parallel and the rollouts' seconds per episode (where the learner
    reports them)."""
    rows = []
    for r in summary.steps_log:
        means = r.get("episode_means") or {}
        if not means:
            continue
        rows.append(
            {
                "step": float(r["step"]),
                "subagents": float(means.get("subagents", 0.0)),
                "parallel_turns": float(means.get("parallel_turns", 0.0)),
                "critical_steps": float(means.get("critical_steps", 0.0)),
                "perf": float(means.get("component.perf", 0.0)),
                # the rollouts' wall clock per episode, sub-agents included (the pool's, where it ran)
                **({"latency_s": float(means["wall_ms"]) / 1000} if "wall_ms" in means else {}),
                "lambda_parallel": float((r.get("reward_weights") or {}).get("parallel", 1.0)),
            }
        )
    return rows


def plot(report: dict[str, Any], path: Path) -> Path:
    """The swarm arm's parallelism curve by learner step (sub-agents and parallel turns per episode) and
    its critical steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    curve = report.get("curve") or []
    steps = report.get("steps", 0)
    fig, (ax1, ax3, ax2) = plt.subplots(1, 3, figsize=(14, 4))
    # (axis, the batches' key, the evaluations' key, label); a turn running 2+ sub-agents at once is
    # a parallel turn: the batches report them per episode, the evaluations the share of episodes with one
    panels = (
        (ax1, "subagents", "subagents", "sub-agents per episode"),
        (ax3, "parallel_turns", "parallel_rate", "parallel turns per episode / parallel rate (evals)"),
        (ax2, "critical_steps", "critical_steps", "critical steps per episode"),
    )
    for ax, key, eval_key, label in panels:
        if curve and all(key in c for c in curve):
            ax.plot([c["step"] for c in curve], [c[key] for c in curve], marker=".", label="train batches")
        for stage, x in (("before", 0), ("after", steps)):
            for split, marker in (("train", "o"), ("heldout", "s")):
                row = report.get(f"{stage}/swarm/{split}")
                if row and eval_key in row:
                    ax.scatter([x], [row[eval_key]], marker=marker, label=f"{split} eval ({stage})")
        ax.set_xlabel("learner step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    budget = report.get("budget")
    if budget:
        ax2.axhline(budget, color="grey", linestyle="--", label="evaluations' budget (train tasks may draw more)")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.suptitle(f"slipstream demo --env swarm, swarm arm: parallelism during RL (seed {report.get('seed', '?')})")
    fig.tight_layout()
    return save(fig, path, dpi=100)


def table(report: dict[str, Any]) -> Any:
    """Each arm's model in its own mode, train and held-out, before and after RL: one row per (stage, split, arm)."""
    from rich.table import Table

    t = Table(
        title="swarm vs single agent (each trained in its own right; same items and budget)", title_justify="left"
    )
    short = {
        "critical_steps": "crit",
        "total_steps": "total",
        "subagents": "subs",
        "parallel_rate": "par",
        "latency_s": "lat s",
        "finish_rate": "finish",
        "over_budget": "over",
    }
    arms = report.get("arms") or list(ARMS)
    for col in ("model", "split", "arm", *(short.get(k, k) for k in FIGURES)):
        t.add_column(col)
    for stage in ("before", "after", "ceiling"):
        for split in ("train", "heldout"):
            for arm in arms:
                row = report.get(f"{stage}/{arm}/{split}")
                if row is None and stage == "ceiling":
                    continue  # the swarm's alone: its sub-agents under the teacher's parallel orchestrator
                row = row or {}
                t.add_row(stage, split, arm, *(f"{row[k]:.3f}" if k in row else "-" for k in FIGURES))
    return t


def _report_head(plan: Any, rl_budgets: list[int] | None) -> dict[str, Any]:
    """swarm.json's first keys: the plan's figures every arm shares."""
    o = plan.env_options
    return {
        "seed": plan.seed,
        "steps": plan.max_steps,
        "budget": o.get("max_critical_steps"),
        "item_counts": o.get("item_counts"),
        "expert_parallel_rate": o.get("expert_parallel_rate"),
        "train_budgets": {"warmstart": o.get("train_budgets"), "rl": rl_budgets or o.get("train_budgets")},
        "arms": [],
    }


def _close(
    report: dict[str, Any],
    curves: dict[str, dict[str, Any]],
    run_dir: Path,
    failed: str,
    args: argparse.Namespace,
    console: Any,
    t0: float,
    summaries: dict[str, Any] | None = None,
) -> int:
    """The report's closing figures, table and plots; swarm.json (and --summary-json) written."""
    import msgspec
    from rich.markup import escape

    report["parallel_rate_before_rl"] = {
        a: report.get(f"before/{a}/heldout", {}).get("parallel_rate") for a in report["arms"]
    }
    report["latency_s"] = {
        a: {
            "eval_after": report.get(f"after/{a}/heldout", {}).get("latency_s"),
            # none where the run's stack was not followed to its end (--swarm-evaluate-run)
            "stack_after": (report[a].get("stack") or {}).get("heldout_after", {}).get("latency_s"),
            # the RL rollouts, first and last steps: where the sub-agents ran is the arm's `subagents_on`
            "rollouts": (report[a].get("stack") or {}).get("rollouts_latency_s") or None,
        }
        for a in report["arms"]
    }
    if len(report["arms"]) > 0 and not failed:
        console.print(table(report))
        for a in report["arms"]:
            lat = report["latency_s"][a]
            console.print(
                f"{a}: held-out parallel rate before RL {report['parallel_rate_before_rl'][a]}, latency per episode "
                f"{lat['eval_after']} s (evaluation), {lat['stack_after']} s (stack)"
                + (
                    f", {lat['rollouts']['first']} -> {lat['rollouts']['last']} s (the RL rollouts, sub-agents on "
                    f"{report[a].get('subagents_on', '?')})"
                    if lat["rollouts"]
                    else ""
                )
            )
    if curves:
        report["budget_curves"] = curves
        (run_dir / "swarm-budget.json").write_text(json.dumps(curves, indent=1))
        console.print(f"accuracy vs budget: {plot_budget(curves, run_dir / 'swarm-budget.png')}")
    if report.get("curve") is not None:
        swarm_key = next(a for a in report["arms"] if a.startswith("swarm"))
        view_report = {
            **report,
            **{k.replace(f"/{swarm_key}/", "/swarm/"): v for k, v in report.items() if f"/{swarm_key}/" in k},
        }
        console.print(f"parallelism curve: {plot(view_report, run_dir / 'swarm.png')}")
    report["wall_s"] = round(time.monotonic() - t0, 1)
    out = run_dir / "swarm.json"
    out.write_bytes(msgspec.json.format(msgspec.json.encode(report)))
    if args.summary_json and summaries is not None:
        args.summary_json.parent.mkdir(parents=True, exist_ok=True)
        whole = {"arms": {k: msgspec.to_builtins(v) for k, v in summaries.items()}, "swarm": report}
        args.summary_json.write_bytes(msgspec.json.format(msgspec.json.encode(whole)))
    if failed:
        console.print(f"[red]slipstream demo --env swarm failed:[/red] {escape(str(failed))}")
        return 1
    console.print(f"done in {report['wall_s']:.0f} s; swarm.json in {run_dir}")
    return 0
