"""`slipstream bench summary`: self-summaries against truncation at the same budget, per seed (issue 14).

For each seed: one warm-start of the tiny model on the env's imperfect teacher, whose episodes
are played with self-summaries (`--warmstart-modes summary,truncate` plays half of them with
truncation instead), then two whole `slipstream demo` runs from that same model, identical but
for `[rollout.summary] mode`:

- `summary`: past the group's context threshold the policy writes a summary and the context
  restarts from the task, the summary and the line still pending (libs/harness summary.py);
  the outcome reward reaches every link's tokens, summaries included.
- `truncate` (the baseline): at the same threshold the context restarts from the task and its
  last `summary_tokens` tokens (the same budget a summary gets), no summary written.

Each arm is evaluated before and after RL in its own mode (held-out and train split, sampled at
the rollout temperature and greedy) with tokens per episode (over all links, and sampled) and
restarts per episode. The verdict compares held-out sampled success after RL, summary minus
truncate, per seed, against the binomial standard error of that difference (counting tasks), and
across seeds (mean, and the smallest difference). `--json FILE` writes every figure and the load.
Exit status 1 if a run failed.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream.bench.demo import _seeds
from slipstream.bench.main import write_json

ARMS = ("summary", "truncate")
SCORES = ("heldout_accuracy", "heldout_greedy", "train_accuracy", "train_greedy")


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "summary",
        help="self-summaries vs truncation at the same context budget, RL on several seeds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--seeds", type=_seeds, default=[0, 1, 2], help="comma-separated seeds (default 0,1,2)")
    p.add_argument("--env", default="recall", help="a multi-turn environment with a demo plan (default recall)")
    p.add_argument("--steps", type=int, default=None, help="learner steps per arm (default: the demo's)")
    p.add_argument("--heldout-tasks", type=int, default=None, help="held-out (and train-split) tasks evaluated")
    p.add_argument("--sft-steps", type=int, default=None, help="cap on the warm-start's steps (default: the demo's)")
    p.add_argument("--arms", default="summary,truncate", help="which arms to run (default summary,truncate)")
    p.add_argument(
        "--warmstart-modes",
        default="summary",
        help="context modes the teacher's warm-start episodes are played under, task i under mode i mod n "
        "(default summary: a teacher that answers '?' after a truncation would teach the model nothing to copy)",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default .slipstream/bench/...)")
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms):
        raise SystemExit(f"--arms takes summary and/or truncate, got {args.arms!r}")
    if any(m not in ARMS for m in args.warmstart_modes.split(",") if m):
        raise SystemExit(f"--warmstart-modes takes summary and/or truncate, got {args.warmstart_modes!r}")
    result = run(args, arms)
    write_json(result, args.json)
    return 0 if result["ok"] else 1


def row_of(seed: int, arm: str, summary: Any) -> dict[str, Any]:
    """One arm of one seed: success before -> after, context figures, wall time."""
    out: dict[str, Any] = {"seed": seed, "arm": arm, "ok": summary.ok, "error": summary.error[-2000:]}
    for field in SCORES:
        out[f"{field}_before"] = round(getattr(summary, f"{field}_before"), 4)
        out[f"{field}_after"] = round(getattr(summary, f"{field}_after"), 4)
    for key, value in summary.context_before.items():
        out[f"{key}_before"] = value
    for key, value in summary.context_after.items():
        out[f"{key}_after"] = value
    out["heldout_tasks"] = summary.heldout_tasks
    out["steps"] = summary.steps
    out["wall_time_s"] = round(summary.wall_time_s, 1)
    out["train_time_s"] = round(summary.train_time_s, 1)
    out["run_dir"] = summary.run_dir
    return out


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Held-out sampled success after RL, summary minus truncate, per seed and across seeds."""
    by = {(r["seed"], r["arm"]): r for r in rows if r["ok"]}
    seeds = sorted({r["seed"] for r in rows})
    per_seed = []
    for seed in seeds:
        s, t = by.get((seed, "summary")), by.get((seed, "truncate"))
        if s is None or t is None:
            continue
        n = s["heldout_tasks"] or 1
        ps, pt = s["heldout_accuracy_after"], t["heldout_accuracy_after"]
        # Binomial standard error of the difference, counting tasks (a task's samples share its facts).
        se = math.sqrt((ps * (1 - ps) + pt * (1 - pt)) / n)
        diff = ps - pt
        per_seed.append(
            {
                "seed": seed,
                "summary_after": ps,
                "truncate_after": pt,
                "difference": round(diff, 4),
                "se": round(se, 4),
                "z": round(diff / se, 2) if se > 0 else None,
                "summary_rl_change": round(ps - s["heldout_accuracy_before"], 4),
                "truncate_rl_change": round(pt - t["heldout_accuracy_before"], 4),
            }
        )
    diffs = [p["difference"] for p in per_seed]
    out: dict[str, Any] = {
        "runs_ok": len(by) == len(rows),
        "per_seed": per_seed,
        "summary_beats_truncate_every_seed": bool(diffs) and all(d > 0 for d in diffs),
        "min_difference": min(diffs) if diffs else None,
        "mean_difference": round(statistics.fmean(diffs), 4) if diffs else None,
    }
    if len(diffs) >= 2:
        sd = statistics.stdev(diffs)
        out["difference_sd_across_seeds"] = round(sd, 4)
        out["t_across_seeds"] = round(statistics.fmean(diffs) / (sd / math.sqrt(len(diffs))), 2) if sd > 0 else None
    return out


def run(args: argparse.Namespace, arms: list[str]) -> dict[str, Any]:
    from rich.console import Console
    from rich.table import Table

    from slipstream.run.presets import demo_plan, with_context
    from slipstream.run.summary_plan import summary_config
    from slipstream.run.training import run_training, warm_start

    console = Console(highlight=False)
    root = (args.run_dir or Path(".slipstream/bench") / time.strftime("summary-%Y%m%d-%H%M%S")).resolve()
    rows: list[dict[str, Any]] = []
    warmstarts: dict[int, dict[str, Any]] = {}
    loads: list[tuple[float, float, float]] = [os.getloadavg()]
    for seed in args.seeds:
        plans = {}
        for arm in ARMS:
            plan = with_context(demo_plan(args.env), arm)
            plan.seed = seed
            if args.steps is not None:
                plan.max_steps = args.steps
            if args.heldout_tasks is not None:
                plan.heldout_tasks = plan.train_eval_tasks = args.heldout_tasks
            if args.sft_steps is not None:
                plan.sft_steps = args.sft_steps
            plan.eval_every = 0
            plans[arm] = plan
        modes = [summary_config(plans[a]) for a in args.warmstart_modes.split(",") if a]
        if not modes or any(m is None for m in modes):
            raise SystemExit(f"env {args.env!r}: its demo plan has no summary config to compare")
        model_dir = root / f"seed{seed}" / "model-init"
        console.print(f"[bold]seed {seed}[/bold]: warm-start on {args.env} ({args.warmstart_modes}) ...")
        t0 = time.monotonic()
        figures = warm_start(plans["summary"], model_dir, summary_modes=modes)
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        warmstarts[seed] = figures
        console.print(
            f"  {figures['steps']} steps, probe {figures.get('probe_accuracy', -1):.3f}, {figures['wall_s']:.0f} s"
        )
        for arm in arms:
            plan = plans[arm]
            loads.append(os.getloadavg())
            console.print(f"  {arm}: {plan.max_steps} steps (load {loads[-1][0]:.1f}) ...")
            summary = run_training(plan, root / f"seed{seed}" / arm, init_model=(model_dir, dict(figures)))
            if not summary.ok:
                console.print(f"[red]seed {seed} {arm} failed:[/red] {summary.error[-1500:]}")
            rows.append(row_of(seed, arm, summary))
            r = rows[-1]
            console.print(
                f"    held-out {r['heldout_accuracy_before']:.3f} -> {r['heldout_accuracy_after']:.3f} sampled, "
                f"train {r['train_accuracy_before']:.3f} -> {r['train_accuracy_after']:.3f}; tokens/episode "
                f"{r.get('heldout_tokens_per_episode_after', 0):.0f}; {r['wall_time_s']:.0f} s"
            )
    loads.append(os.getloadavg())

    def pair(r: dict[str, Any], field: str, fmt: str = ".3f") -> str:
        before, after = r.get(f"{field}_before"), r.get(f"{field}_after")
        if before is None or after is None:
            return "-"
        return f"{before:{fmt}} -> {after:{fmt}}"

    t = Table(title=f"slipstream bench summary — {args.env}, {len(args.seeds)} seeds")
    cols = ["seed", "arm", "held-out sampled", "held-out greedy", "train sampled", "tokens/ep", "sampled tok/ep"]
    for col in (*cols, "restarts/ep", "wall s"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(
            str(r["seed"]) + ("" if r["ok"] else " FAILED"),
            r["arm"],
            pair(r, "heldout_accuracy"),
            pair(r, "heldout_greedy"),
            pair(r, "train_accuracy"),
            pair(r, "heldout_tokens_per_episode", ".0f"),
            pair(r, "heldout_sampled_tokens_per_episode", ".0f"),
            pair(r, "heldout_restarts_per_episode", ".2f"),
            f"{r['wall_time_s']:.0f}",
        )
    console.print(t)
    v = verdict(rows)
    for p in v["per_seed"]:
        console.print(
            f"seed {p['seed']}: summary {p['summary_after']:.3f} vs truncate {p['truncate_after']:.3f} held-out "
            f"after RL: difference {p['difference']:+.3f} (standard error {p['se']:.3f}, z {p['z']})"
        )
    console.print(
        f"summary beat truncate in every seed: {v['summary_beats_truncate_every_seed']}; mean difference "
        f"{v['mean_difference']}, least {v['min_difference']} (load average {loads[0][0]:.1f} at start, "
        f"{loads[-1][0]:.1f} at end, {os.cpu_count()} CPUs)"
    )
    # The summary arm's plan as run, the command line's overrides included (seed: the last one's).
    plan = plans["summary"]
    return {
        "ok": v["runs_ok"],
        "env": args.env,
        "plan": {k: getattr(plan, k) for k in plan.__struct_fields__},
        "arms": arms,
        "warmstarts": warmstarts,
        "seeds": rows,
        "verdict": v,
        "load_average_1m": [round(x[0], 2) for x in loads],
        "cpus": os.cpu_count(),
    }
