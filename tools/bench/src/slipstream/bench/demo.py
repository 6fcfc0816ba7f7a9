"""`slipstream bench demo`: the default demo (what `make demo` runs) once per seed, train vs held-out.

Each seed is a whole `slipstream demo` run on the local stack (warm-start, nats-server, Redis,
the five pipeline services as separate processes, held-out and train-split evals before and
after), with only the seed changed: it seeds the tiny model's initialisation, the warm-start's
tasks, the task stream, the held-out and train-split sets and the learner. Printed per seed:
train-split and held-out accuracy before -> after RL, sampled (rollout temperature, the plan's
samples per task) and greedy, and the run's wall time; then whether held-out sampled and greedy
accuracy rose in every seed; for a tool env (`--env lookup`) also the invalid-call rate before
-> after, whether it fell in every seed, and the warm-start's steps; then the noise a rise is
judged against (the largest binomial standard error of one seed's held-out change, counting
tasks, and the spread of the seeds' starting points). For an env with figures of its own (search:
final-answer-found, prune share, ...) each figure's change per seed, train beside held-out, with its
mean, sd and standard error across seeds and the mean in standard errors (`metric_margins`).
`--json FILE` writes every figure plus the machine's load average.

`--merge FILE ...` reports runs already made (`slipstream demo --summary-json FILE`, one a seed, e.g.
run side by side as separate processes) the same way, without running anything.
Exit status 1 if a run failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

FIGURES = (
    ("train", "train_accuracy"),
    ("held-out", "heldout_accuracy"),
    ("held-out greedy", "heldout_greedy"),
    ("train greedy", "train_greedy"),
)


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "demo",
        help="the default demo on several seeds: train vs held-out accuracy before/after, wall time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", metavar="FILE", default="", help="write the results as JSON to FILE")
    p.add_argument("--seeds", type=_seeds, default=[0, 1, 2, 3, 4], help="comma-separated seeds (default 0,1,2,3,4)")
    p.add_argument("--env", default=None, help="environment (default: the default demo's)")
    p.add_argument("--steps", type=int, default=None, help="learner steps (default: the demo's)")
    p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default .slipstream/bench/demo-<ts>)")
    p.add_argument(
        "--length-penalty",
        type=float,
        default=None,
        metavar="SCALE",
        help="the env's length penalty scale (code: default 5e-4; 0: off)",
    )
    p.add_argument(
        "--task-sampler",
        choices=("off", "pass_rate"),
        default=None,
        help="the task source's sampler (default the demo's)",
    )
    p.add_argument(
        "--screen", type=float, default=None, metavar="TARGET", help="the workers' task screen target (0: off)"
    )
    p.add_argument(
        "--merge",
        nargs="+",
        type=Path,
        default=None,
        metavar="FILE",
        help="report these `slipstream demo --summary-json` files (one a seed) instead of running",
    )
    p.set_defaults(func=_command)


def _seeds(text: str) -> list[int]:
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--seeds takes comma-separated integers, got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError("--seeds needs at least one seed")
    return seeds


def _command(args: argparse.Namespace) -> int:
    result = merge(args.merge) if getattr(args, "merge", None) else run(args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


def row_of(seed: int, summary: Any) -> dict[str, Any]:
    """One seed's figures from its RunSummary."""
    out: dict[str, Any] = {"seed": seed, "ok": summary.ok, "error": summary.error, "run_dir": summary.run_dir}
    for _, field in FIGURES:
        out[f"{field}_before"] = getattr(summary, f"{field}_before")
        out[f"{field}_after"] = getattr(summary, f"{field}_after")
    for field in ("heldout_invalid_call_rate", "train_invalid_call_rate", "heldout_tool_calls"):
        out[f"{field}_before"] = getattr(summary, f"{field}_before")
        out[f"{field}_after"] = getattr(summary, f"{field}_after")
    for field in ("heldout_metrics", "train_metrics"):
        out[f"{field}_before"] = dict(getattr(summary, f"{field}_before"))
        out[f"{field}_after"] = dict(getattr(summary, f"{field}_after"))
    for field in ("heldout_tokens_per_episode", "heldout_sampled_tokens_per_episode"):
        out[f"{field}_before"] = summary.context_before.get(field, -1.0)
        out[f"{field}_after"] = summary.context_after.get(field, -1.0)
    out["heldout_tasks"] = summary.heldout_tasks
    out["warmstart_steps"] = summary.warmstart.get("steps", 0)
    out["warmstart_probe"] = summary.warmstart.get("probe_accuracy", -1.0)
    out["wall_time_s"] = round(summary.wall_time_s, 1)
    out["train_time_s"] = round(summary.train_time_s, 1)
    out["steps"] = summary.steps
    out["trained_share"] = trained_share(summary.trajectories)
    return out


def trained_share(trajectories: dict[str, Any]) -> float:
    """Trained trajectories per scored one (-1 when nothing was scored): the rest were dropped."""
    scored = trajectories.get("scored") or 0
    return round(trajectories.get("trained", 0) / scored, 4) if scored else -1.0


def verdict(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Did held-out sampled and greedy accuracy rise in every seed; medians of every change."""
    ok = [r for r in rows if r["ok"]]
    rises = {
        field: [r[f"{field}_after"] - r[f"{field}_before"] for r in ok]
        for _, field in FIGURES
        if ok and ok[0][f"{field}_before"] >= 0
    }
    invalid = [r["heldout_invalid_call_rate_after"] - r["heldout_invalid_call_rate_before"] for r in ok]
    if ok and any(r["heldout_invalid_call_rate_before"] or r["heldout_tool_calls_before"] for r in ok):
        rises["heldout_invalid_call_rate"] = invalid
    # The noise a rise is judged against: the binomial standard error of one seed's held-out
    # change (before and after each from heldout_tasks tasks; counting tasks, not samples, since
    # a task's samples share its key), and the spread of the starting points across seeds.
    noise = [
        math.sqrt(
            sum(p * (1 - p) for p in (r["heldout_accuracy_before"], r["heldout_accuracy_after"])) / r["heldout_tasks"]
        )
        for r in ok
        if r["heldout_tasks"]
    ]
    befores = [r["heldout_accuracy_before"] for r in ok]
    return {
        "runs_ok": len(ok) == len(rows),
        "heldout_change_se_max": round(max(noise), 4) if noise else None,
        "heldout_before_spread": round(max(befores) - min(befores), 4) if befores else None,
        "heldout_sampled_rose_every_seed": bool(ok) and all(d > 0 for d in rises["heldout_accuracy"]),
        "heldout_greedy_rose_every_seed": bool(ok) and all(d > 0 for d in rises["heldout_greedy"]),
        "heldout_invalid_call_rate_fell_every_seed": bool(invalid) and all(d < 0 for d in invalid),
        "median_change": {k: round(statistics.median(v), 4) for k, v in rises.items() if v},
        # The least improvement per figure: the smallest rise, or for the invalid-call rate the smallest fall.
        "min_change": {
            k: round(max(v) if k == "heldout_invalid_call_rate" else min(v), 4) for k, v in rises.items() if v
        },
        # The env's own figures (search: final_answer_found, output_recall, ...): held-out change per seed.
        "heldout_metric_change": metric_changes(ok),
        "metric_margins": {split: metric_margins(ok, split) for split in ("heldout", "train")},
        "median_wall_time_s": round(statistics.median(r["wall_time_s"] for r in rows), 1),
        "max_wall_time_s": round(max(r["wall_time_s"] for r in rows), 1),
    }


def metric_changes(rows: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Per env figure that every row has before and after (search's final_answer_found, ...): its
    held-out change in each row, in row order. Rows without env figures give none."""
    if not rows:
        return {}
    names = set.intersection(
        *(set(r.get("heldout_metrics_before", {})) & set(r.get("heldout_metrics_after", {})) for r in rows)
    )
    return {
        k: [round(r["heldout_metrics_after"][k] - r["heldout_metrics_before"][k], 4) for r in rows]
        for k in sorted(names)
    }


def metric_margins(rows: list[dict[str, Any]], split: str = "heldout") -> dict[str, dict[str, float | None]]:
    """Per env figure every row has before and after on `split`: the changes' mean, sd and standard
    error across the rows (seeds), and the mean in standard errors (`t`; None with one seed or no
    spread). A rise is justified by the seeds' spread when `t` is well above 2."""
    field = f"{split}_metrics"
    if not rows:
        return {}
    names = set.intersection(*(set(r.get(f"{field}_before", {})) & set(r.get(f"{field}_after", {})) for r in rows))
    out: dict[str, dict[str, float | None]] = {}
    for k in sorted(names - {"episodes", "budget_refusals"}):
        changes = [r[f"{field}_after"][k] - r[f"{field}_before"][k] for r in rows]
        mean = statistics.fmean(changes)
        sd = statistics.stdev(changes) if len(changes) > 1 else None
        se = sd / math.sqrt(len(changes)) if sd is not None else None
        out[k] = {
            "before_mean": round(statistics.fmean(r[f"{field}_before"][k] for r in rows), 4),
            "after_mean": round(statistics.fmean(r[f"{field}_after"][k] for r in rows), 4),
            "change_mean": round(mean, 4),
            "change_sd": None if sd is None else round(sd, 4),
            "change_se": None if se is None else round(se, 4),
            "t": None if not se else round(mean / se, 2),
        }
    return out


def merge(paths: list[Path]) -> dict[str, Any]:
    """The report of `run` for runs already made: `slipstream demo --summary-json` files, one a seed,
    all of one env (SystemExit naming the file otherwise)."""
    import msgspec

    from slipstream.run.training import RunSummary

    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise SystemExit(f"--merge: no such file: {', '.join(missing)}")
    summaries = []
    for p in paths:
        try:
            summaries.append(msgspec.json.decode(p.read_bytes(), type=RunSummary))
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise SystemExit(f"--merge: {p} is not a `slipstream demo --summary-json` file: {e}") from None
        if summaries[-1].plan.env != summaries[0].plan.env:
            raise SystemExit(f"--merge: {p} ran env {summaries[-1].plan.env!r}, {paths[0]} {summaries[0].plan.env!r}")
    seeds = [s.plan.seed for s in summaries]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"--merge: a seed appears in more than one file ({sorted(seeds)})")
    rows = [{**row_of(s.plan.seed, s), "file": str(p)} for s, p in zip(summaries, paths, strict=True)]
    return {**report(rows, summaries[0].plan, []), "merged": [str(p) for p in paths]}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from rich.console import Console

    from slipstream.run.presets import demo_plan, with_length_penalty
    from slipstream.run.training import run_training

    console = Console(highlight=False)
    root = args.run_dir or Path(".slipstream/bench") / time.strftime("demo-%Y%m%d-%H%M%S")
    rows: list[dict[str, Any]] = []
    loads: list[tuple[float, float, float]] = []
    for seed in args.seeds:
        plan = demo_plan(args.env)
        plan.seed = seed
        if args.steps is not None:
            plan.max_steps = args.steps
        if getattr(args, "task_sampler", None) is not None:
            plan.task_sampler = args.task_sampler
        if getattr(args, "screen", None) is not None:
            plan.screen_target = args.screen
        with_length_penalty(plan, getattr(args, "length_penalty", None))
        plan.eval_every = 0  # before and after only: the figures compared
        loads.append(os.getloadavg())
        console.print(f"[bold]seed {seed}[/bold]: {plan.max_steps} steps on {plan.env} (load {loads[-1][0]:.1f}) ...")
        summary = run_training(plan, root / f"seed{seed}")
        if not summary.ok:
            console.print(f"[red]seed {seed} failed:[/red] {summary.error}")
        rows.append(row_of(seed, summary))
        r = rows[-1]
        console.print(
            f"  held-out {r['heldout_accuracy_before']:.3f} -> {r['heldout_accuracy_after']:.3f} sampled, "
            f"{r['heldout_greedy_before']:.3f} -> {r['heldout_greedy_after']:.3f} greedy, invalid calls "
            f"{r['heldout_invalid_call_rate_before']:.3f} -> {r['heldout_invalid_call_rate_after']:.3f}, "
            f"sampled tokens per episode {r['heldout_sampled_tokens_per_episode_before']:.0f} -> "
            f"{r['heldout_sampled_tokens_per_episode_after']:.0f}; {r['wall_time_s']:.0f} s"
        )
        metrics = [
            f"{k} {r['heldout_metrics_before'][k]:.3f} -> {r['heldout_metrics_after'].get(k, float('nan')):.3f}"
            for k in ("final_answer_found", "output_recall", "traj_recall", "f1", "turns_per_episode")
            if k in r["heldout_metrics_before"]
        ]
        if metrics:
            console.print("  held-out " + ", ".join(metrics))
    loads.append(os.getloadavg())
    return report(rows, with_length_penalty(demo_plan(args.env), getattr(args, "length_penalty", None)), loads)


def _loads(loads: list[tuple[float, float, float]]) -> str:
    if not loads:
        return ""
    return f" (load average {loads[0][0]:.1f} at start, {loads[-1][0]:.1f} at end, {os.cpu_count()} CPUs)"


def report(rows: list[dict[str, Any]], plan: Any, loads: list[tuple[float, float, float]]) -> dict[str, Any]:
    """Print the seeds' table and verdict; the result `--json` writes (`loads`: the load averages at the
    start and end, none for merged runs)."""
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False)

    def pair(r: dict[str, Any], field: str) -> str:
        before, after = r[f"{field}_before"], r[f"{field}_after"]
        return "-" if before < 0 else f"{before:.3f} -> {after:.3f}"

    t = Table(title=f"slipstream bench demo — {len(rows)} seeds")
    tools = any(r["heldout_invalid_call_rate_before"] or r["heldout_tool_calls_before"] for r in rows)
    cols = ["seed", "train sampled", "held-out sampled", "train greedy", "held-out greedy"]
    cols += ["held-out invalid calls", "warm-start steps"] if tools else []
    for col in (*cols, "trained share", "wall s"):
        t.add_column(col, justify="right")
    for r in rows:
        cells = [
            str(r["seed"]) + ("" if r["ok"] else " FAILED"),
            pair(r, "train_accuracy"),
            pair(r, "heldout_accuracy"),
            pair(r, "train_greedy"),
            pair(r, "heldout_greedy"),
        ]
        if tools:
            cells += [pair(r, "heldout_invalid_call_rate"), str(r["warmstart_steps"])]
        t.add_row(*cells, f"{r['trained_share']:.3f}", f"{r['wall_time_s']:.0f}")
    console.print(t)
    v = verdict(rows)
    console.print(
        f"held-out sampled rose in every seed: {v['heldout_sampled_rose_every_seed']}; "
        f"greedy: {v['heldout_greedy_rose_every_seed']}; invalid-call rate fell in every seed: "
        f"{v['heldout_invalid_call_rate_fell_every_seed']}; median change {v['median_change']}; "
        f"least improvement {v['min_change']}; held-out noise: standard error of one seed's change <= "
        f"{v['heldout_change_se_max']}, spread of the starting points {v['heldout_before_spread']}; "
        f"wall time median {v['median_wall_time_s']:.0f} s, max {v['max_wall_time_s']:.0f} s{_loads(loads)}"
    )
    if v["heldout_metric_change"]:
        console.print(f"held-out env figures, change per seed: {v['heldout_metric_change']}")
    margins = v["metric_margins"]
    if margins["heldout"]:
        t = Table(title=f"{plan.env} figures over {len(rows)} seeds — mean before -> after (change mean +- sd; t)")
        t.add_column("figure")
        for split in ("train", "held-out"):
            t.add_column(split, justify="right")

        def cell(m: dict[str, Any] | None) -> str:
            if m is None:
                return "-"
            spread = "" if m["change_sd"] is None else f" +- {m['change_sd']:.3f}"
            return f"{m['before_mean']:.3f} -> {m['after_mean']:.3f} ({m['change_mean']:+.3f}{spread}; t {m['t']})"

        for k in margins["heldout"]:
            t.add_row(k, cell(margins["train"].get(k)), cell(margins["heldout"][k]))
        console.print(t)
    return {
        "ok": v["runs_ok"],
        "env": plan.env,
        "plan": {k: getattr(plan, k) for k in plan.__struct_fields__},
        "seeds": rows,
        "verdict": v,
        "load_average_1m": [round(x[0], 2) for x in loads],
        "cpus": os.cpu_count(),
    }
