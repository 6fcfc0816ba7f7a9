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

Learned timing and content (issue 33): `--plan examples/recall_learned.toml --arms
policy,masked --no-rl summary,truncate` runs the plan where the policy opens a summary itself at
any turn and a context that reaches the threshold unsummarised is truncated:

- `policy`: RL with the summaries' tokens trained (their timing and content both earn reward);
- `masked` (control a): the same RL with the summary tokens masked from the loss;
- `--no-rl summary` (control b): the warm-start, without RL, evaluated with the summaries the
  harness asks for at the threshold; the `policy` arm's "before" is the same warm-start
  summarising of its own accord;
- `--no-rl truncate` (control c): no summaries, truncation at the same threshold. On that plan it
  scores 0 by construction (every fact arrives before the first cut), so every group's rewards are
  equal and an RL arm of it would never step: it is evaluated, not trained.

Each arm is evaluated before and after RL in its own mode (held-out and train split, sampled at
the rollout temperature and greedy) with tokens per episode (over all links, and sampled),
restarts per episode and the env's own figures (recall: when summaries opened, what they kept).
The verdict compares held-out sampled success after RL, the first arm minus each other arm, per
seed, against the binomial standard error of that difference (counting tasks), and across seeds
(mean, and the smallest difference). With `--json FILE` it writes every figure and the load, and
beside it FILE's stem + `-timing.png`: when the policy opened its first summary, before and after
RL, against the turn the fixed threshold first restarted the context. Exit status 1 if a run failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

from slipstream.bench.demo import _seeds
from slipstream.bench.main import write_json
from slipstream.bench.swarm_seeds import sign_flip_p

ARMS = ("summary", "truncate", "policy", "masked")
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
    p.add_argument(
        "--plan", type=Path, default=None, help="a run file to compare arms of (default: the env's demo plan)"
    )
    p.add_argument(
        "--arms",
        default="summary,truncate",
        help=f"which arms to run, the first compared with the others ({', '.join(ARMS)}; default summary,truncate)",
    )
    p.add_argument(
        "--no-rl",
        default="",
        metavar="MODES",
        help="also evaluate each seed's warm-start without RL under these context modes, comma-separated "
        "(summary: the summaries the harness asks for, control b; truncate: where RL has no signal to use)",
    )
    p.add_argument(
        "--warmstart-modes",
        default="",
        help="context modes the teacher's warm-start episodes are played under, task i under mode i mod n "
        "(default: the first arm's; a teacher that answers '?' after a truncation would teach nothing to copy)",
    )
    p.add_argument("--run-dir", type=Path, default=None, help="where the runs go (default .slipstream/bench/...)")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="run nothing: report the seeds of these --json files as one bench (seeds run side by side)",
    )
    p.set_defaults(func=_command)


def _command(args: argparse.Namespace) -> int:
    if args.merge:
        missing = [str(p) for p in args.merge if not p.is_file()]
        if missing:
            raise SystemExit(f"--merge: no such file: {', '.join(missing)}")
        merged = merge(args.merge, args.json)
        write_json(merged, args.json)
        return 0 if merged["ok"] else 1
    arms = [a for a in args.arms.split(",") if a]
    if not arms or any(a not in ARMS for a in arms) or len(set(arms)) < len(arms):
        raise SystemExit(f"--arms takes distinct arms of {', '.join(ARMS)}, got {args.arms!r}")
    if any(m not in ARMS for m in args.warmstart_modes.split(",") if m):
        raise SystemExit(f"--warmstart-modes takes modes of {', '.join(ARMS)}, got {args.warmstart_modes!r}")
    if any(m not in ARMS for m in args.no_rl.split(",") if m):
        raise SystemExit(f"--no-rl takes modes of {', '.join(ARMS)}, got {args.no_rl!r}")
    if args.plan is not None and not args.plan.is_file():
        raise SystemExit(f"--plan {args.plan}: no such run file")
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
    # The learner's batches, step by step: how often and at what context size the policy summarised.
    out["curve"] = [step_point(r) for r in summary.steps_log]
    out["heldout_metrics_before"] = dict(summary.heldout_metrics_before)
    out["heldout_metrics_after"] = dict(summary.heldout_metrics_after)
    out["train_metrics_before"] = dict(summary.train_metrics_before)
    out["train_metrics_after"] = dict(summary.train_metrics_after)
    out["heldout_tasks"] = summary.heldout_tasks
    out["steps"] = summary.steps
    out["wall_time_s"] = round(summary.wall_time_s, 1)
    out["train_time_s"] = round(summary.train_time_s, 1)
    out["run_dir"] = summary.run_dir
    return out


def step_point(row: dict[str, Any]) -> dict[str, float]:
    """One learner step's batch figures (a `steps_log` row or a learner `step` log line)."""
    means = row.get("episode_means") or {}
    opened = means.get("policy_summaries", 0.0)
    return {
        "step": float(row["step"]),
        "accuracy": float(row.get("accuracy", 0.0)),
        "policy_summaries": float(opened),
        # summary_context_tokens is summed per episode: per summary, it is the context size where one opened.
        "context_at_summary": round(means.get("summary_context_tokens", 0.0) / opened, 2) if opened else 0.0,
        "truncations": float(means.get("truncations", 0.0)),
    }


def verdict(rows: list[dict[str, Any]], arms: tuple[str, ...] = ("summary", "truncate")) -> dict[str, Any]:
    """Held-out sampled success after RL, the first arm minus each other arm, per seed and across seeds.

    With the default arms the keys keep their first names (`summary_after`, `truncate_after`,
    `summary_beats_truncate_every_seed`); every comparison is also under `comparisons[other]`."""
    by = {(r["seed"], r["arm"]): r for r in rows if r["ok"]}
    seeds = sorted({r["seed"] for r in rows})
    lead = arms[0]
    comparisons: dict[str, Any] = {}
    for other in arms[1:]:
        per_seed = []
        for seed in seeds:
            s, t = by.get((seed, lead)), by.get((seed, other))
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
                    f"{lead}_after": ps,
                    f"{other}_after": pt,
                    "difference": round(diff, 4),
                    "se": round(se, 4),
                    "z": round(diff / se, 2) if se > 0 else None,
                    f"{lead}_rl_change": round(ps - s["heldout_accuracy_before"], 4),
                    f"{other}_rl_change": round(pt - t["heldout_accuracy_before"], 4),
                }
            )
        diffs = [p["difference"] for p in per_seed]
        c: dict[str, Any] = {
            "per_seed": per_seed,
            "beats_every_seed": bool(diffs) and all(d > 0 for d in diffs),
            "min_difference": min(diffs) if diffs else None,
            "mean_difference": round(statistics.fmean(diffs), 4) if diffs else None,
            # Exact, one-sided: 3 seeds cannot give p below 1/8, 6 below 1/64 (swarm_seeds.sign_flip_p).
            "p_sign_flip": sign_flip_p(diffs),
        }
        if len(diffs) >= 2:
            sd = statistics.stdev(diffs)
            c["difference_sd_across_seeds"] = round(sd, 4)
            c["t_across_seeds"] = round(statistics.fmean(diffs) / (sd / math.sqrt(len(diffs))), 2) if sd > 0 else None
        comparisons[other] = c
    out: dict[str, Any] = {"runs_ok": len(by) == len(rows), "lead": lead, "comparisons": comparisons}
    first = comparisons.get(arms[1]) if len(arms) > 1 else None
    if first is not None:  # the two-arm form's keys, as before
        out["per_seed"] = first["per_seed"]
        out[f"{lead}_beats_{arms[1]}_every_seed"] = first["beats_every_seed"]
        for key in ("min_difference", "mean_difference", "difference_sd_across_seeds", "t_across_seeds", "p_sign_flip"):
            if key in first:
                out[key] = first[key]
    else:
        out["per_seed"] = []
    return out


def timing(rows: list[dict[str, Any]], split: str = "heldout") -> dict[str, Any]:
    """Per arm, before and after RL, the mean over seeds of the share of episodes whose first policy
    summary opened at each turn (`summary_at_turn_<k>`), its mean turn, and the fixed threshold's
    mean first-restart turn; arms whose policy never summarised are left out."""
    out: dict[str, Any] = {}
    for arm in sorted({r["arm"] for r in rows}):
        mine = [r for r in rows if r["arm"] == arm and r["ok"]]
        figures: dict[str, Any] = {}
        for when in ("before", "after"):
            metrics = [r.get(f"{split}_metrics_{when}") or {} for r in mine]
            turns = sorted({int(k.rpartition("_")[2]) for m in metrics for k in m if k.startswith("summary_at_turn_")})
            if not turns:
                continue
            hist = [round(statistics.fmean(m.get(f"summary_at_turn_{k}", 0.0) for m in metrics), 4) for k in turns]
            figures[when] = {
                "turns": turns,
                "share": hist,
                "summarised": round(statistics.fmean(m.get("summarised", 0.0) for m in metrics), 4),
                "summary_turn": _mean([m["summary_turn"] for m in metrics if "summary_turn" in m]),
                "kept_asked": _mean([m["kept_asked"] for m in metrics if "kept_asked" in m]),
                "kept_value": _mean([m["kept_value"] for m in metrics if "kept_value" in m]),
                "threshold_turn": _mean([m["threshold_turn"] for m in metrics if "threshold_turn" in m]),
            }
        if figures:
            out[arm] = figures
    after = [r.get(f"{split}_metrics_after") or {} for r in rows]
    threshold = [m["threshold_turn"] for m in after if "threshold_turn" in m]
    if threshold:
        out["fixed_threshold_turn"] = _mean(threshold)
    return out


def _mean(values: list[float]) -> float | None:
    return round(statistics.fmean(values), 3) if values else None


def curves(rows: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """Per arm, the mean over seeds of the context size at which the policy opened a summary, by learner step."""
    out: dict[str, list[tuple[float, float]]] = {}
    for arm in sorted({r["arm"] for r in rows}):
        by_step: dict[float, list[float]] = {}
        for r in rows:
            if r["arm"] == arm and r["ok"]:
                for point in r.get("curve") or []:
                    if point["policy_summaries"]:
                        by_step.setdefault(point["step"], []).append(point["context_at_summary"])
        if by_step:
            out[arm] = [(step, statistics.fmean(v)) for step, v in sorted(by_step.items())]
    return out


def plot_timing(
    figures: dict[str, Any], path: Path, title: str, steps: dict[str, list[tuple[float, float]]] | None = None
) -> Path | None:
    """When the policy opened its first summary (share of held-out episodes by turn), before and after RL,
    one panel per arm, with the fixed threshold's mean first-restart turn; below, when `steps` has them,
    the context size at which summaries opened in the learner's batches, step by step. None without
    matplotlib or data."""
    arms = [a for a in figures if a != "fixed_threshold_turn"]
    if not arms:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    rows = 2 if steps else 1
    fig, axes = plt.subplots(rows, len(arms), figsize=(5.5 * len(arms), 3.8 * rows), squeeze=False)
    for ax, arm in zip(axes[0], arms, strict=True):
        for when, colour in (("before", "tab:gray"), ("after", "tab:blue")):
            f = figures[arm].get(when)
            if f:
                width = 0.4
                shift = -width / 2 if when == "before" else width / 2
                label = f"{'warm-start' if when == 'before' else 'after RL'}: summarised {f['summarised']:.2f}"
                ax.bar([t + shift for t in f["turns"]], f["share"], width=width, color=colour, label=label)
        line = figures.get("fixed_threshold_turn")
        if line is not None:
            ax.axvline(
                line, color="tab:red", linestyle="--", label=f"fixed threshold: mean first restart, turn {line:.1f}"
            )
        ax.set_xlabel("turn at which the policy opened its first summary")
        ax.set_ylabel("share of held-out episodes")
        ax.set_title(f"arm: {arm}")
        ax.legend(fontsize=7)
    if steps:
        for ax, arm in zip(axes[1], arms, strict=True):
            points = steps.get(arm) or []
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], color="tab:blue")
            ax.set_xlabel("learner step")
            ax.set_ylabel("context tokens where a summary opened")
            ax.set_title(f"arm: {arm}, training batches (mean over seeds)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(
    console: Any,
    rows: list[dict[str, Any]],
    arms: list[str],
    no_rl: dict[int, dict[str, dict[str, Any]]],
    warmstarts: dict[int, dict[str, Any]],
    env: str,
    json_path: str,
) -> dict[str, Any]:
    """Print the arms' table, the verdict (the first arm against each other), the controls without RL
    and the timing figures; with `json_path`, draw the timing plot beside it. Returns the bench's result
    (env, arms, warm-starts, controls, rows, verdict, timing and the plot's path)."""
    n_seeds = len({r["seed"] for r in rows})
    from rich.table import Table

    def pair(r: dict[str, Any], field: str, fmt: str = ".3f") -> str:
        before, after = r.get(f"{field}_before"), r.get(f"{field}_after")
        if before is None or after is None:
            return "-"
        return f"{before:{fmt}} -> {after:{fmt}}"

    t = Table(title=f"slipstream bench summary — {env}, {n_seeds} seeds")
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
    v = verdict(rows, tuple(arms))
    lead = arms[0]
    for other, c in v["comparisons"].items():
        for p in c["per_seed"]:
            console.print(
                f"seed {p['seed']}: {lead} {p[f'{lead}_after']:.3f} vs {other} {p[f'{other}_after']:.3f} held-out "
                f"after RL: difference {p['difference']:+.3f} (standard error {p['se']:.3f}, z {p['z']})"
            )
        spread = (
            f", sd across seeds {c['difference_sd_across_seeds']}, t {c['t_across_seeds']}"
            if "difference_sd_across_seeds" in c
            else ""
        )
        console.print(
            f"{lead} beat {other} in every seed: {c['beats_every_seed']}; mean difference {c['mean_difference']}, "
            f"least {c['min_difference']}{spread}, one-sided sign-flip p {c.get('p_sign_flip')}"
        )
    for seed, by_mode in no_rl.items():
        for mode, f in by_mode.items():
            console.print(f"seed {seed}: the warm-start in mode {mode}, no RL: held-out {f['heldout_accuracy']:.3f}")
    when = timing(rows)
    for arm, f in when.items():
        if arm != "fixed_threshold_turn":
            for k, x in f.items():
                console.print(
                    f"{arm} {k} RL: summarised {x['summarised']:.2f}, first summary at turn {x['summary_turn']} "
                    f"(shares {x['share']}), kept the asked fact {x['kept_asked']} (its value: {x['kept_value']})"
                )
    png = None
    if json_path and when:
        png = plot_timing(
            when,
            Path(json_path).with_name(Path(json_path).stem + "-timing.png"),
            f"When the policy summarised ({env}, {n_seeds} seeds, held-out)",
            curves(rows),
        )
    return {
        "ok": v["runs_ok"],
        "env": env,
        "arms": arms,
        "warmstarts": warmstarts,
        "no_rl": no_rl,
        "seeds": rows,
        "verdict": v,
        "timing": when,
        "timing_png": str(png) if png else None,
    }


def merge(paths: list[Path], json_path: str) -> dict[str, Any]:
    """The seeds of several `bench summary --json` files (one process per seed, run side by side) as
    one result: their rows, warm-starts and controls, the verdict and timing across all of them."""
    from rich.console import Console

    results = [json.loads(p.read_text()) for p in paths]
    arms = results[0]["arms"]
    for p, r in zip(paths, results, strict=True):
        if r["arms"] != arms or r["env"] != results[0]["env"]:
            raise SystemExit(
                f"--merge: {p} ran env {r['env']!r} arms {r['arms']}, {paths[0]} {results[0]['env']!r} {arms}"
            )
    rows = [row for r in results for row in r["seeds"]]
    seeds = [row["seed"] for row in rows if row["arm"] == arms[0]]
    if len(set(seeds)) < len(seeds):
        raise SystemExit(f"--merge: a seed appears in more than one file ({sorted(seeds)})")
    no_rl = {int(k): v for r in results for k, v in r["no_rl"].items()}
    warmstarts = {int(k): v for r in results for k, v in r["warmstarts"].items()}
    out = report(Console(highlight=False), rows, arms, no_rl, warmstarts, results[0]["env"], json_path)
    return {**out, "ok": out["ok"] and all(r["ok"] for r in results), "merged": [str(p) for p in paths]}


def run(args: argparse.Namespace, arms: list[str]) -> dict[str, Any]:
    from rich.console import Console

    from slipstream.run.heldout import held_out
    from slipstream.run.presets import demo_plan, with_context
    from slipstream.run.runfile import load
    from slipstream.run.summary_plan import summary_config
    from slipstream.run.training import run_training, warm_start

    def base_plan() -> Any:
        return load(args.plan).plan() if args.plan is not None else demo_plan(args.env)

    console = Console(highlight=False)
    root = (args.run_dir or Path(".slipstream/bench") / time.strftime("summary-%Y%m%d-%H%M%S")).resolve()
    rows: list[dict[str, Any]] = []
    warmstarts: dict[int, dict[str, Any]] = {}
    no_rl: dict[int, dict[str, dict[str, Any]]] = {}
    loads: list[tuple[float, float, float]] = [os.getloadavg()]
    for seed in args.seeds:
        plans = {}
        for arm in ARMS:
            plan = with_context(base_plan(), arm)
            plan.seed = seed
            if args.steps is not None:
                plan.max_steps = args.steps
            if args.heldout_tasks is not None:
                plan.heldout_tasks = plan.train_eval_tasks = args.heldout_tasks
            if args.sft_steps is not None:
                plan.sft_steps = args.sft_steps
            plan.eval_every = 0
            plans[arm] = plan
        modes = [summary_config(plans[a]) for a in (args.warmstart_modes or arms[0]).split(",") if a]
        if not modes or any(m is None for m in modes):
            raise SystemExit(f"env {plans[arms[0]].env!r}: its plan has no summary config to compare")
        model_dir = root / f"seed{seed}" / "model-init"
        console.print(
            f"[bold]seed {seed}[/bold]: warm-start on {plans[arms[0]].env} ({args.warmstart_modes or arms[0]}) ..."
        )
        t0 = time.monotonic()
        figures = warm_start(plans[arms[0]], model_dir, summary_modes=modes)
        figures["wall_s"] = round(time.monotonic() - t0, 1)
        warmstarts[seed] = figures
        console.print(
            f"  {figures['steps']} steps, probe {figures.get('probe_accuracy', -1):.3f}, {figures['wall_s']:.0f} s"
        )
        for mode in [m for m in args.no_rl.split(",") if m]:
            # A control without RL: the same warm-start, evaluated under another context mode.
            t0 = time.monotonic()
            score = asyncio.run(held_out(plans[mode], model_dir, None, None))
            no_rl.setdefault(seed, {})[mode] = {
                "heldout_accuracy": round(score.accuracy, 4),
                "heldout_greedy": round(score.greedy, 4),
                "train_accuracy": round(score.train_accuracy, 4),
                "train_greedy": round(score.train_greedy, 4),
                "heldout_metrics": dict(score.metrics),
                "train_metrics": dict(score.train_metrics),
                "wall_s": round(time.monotonic() - t0, 1),
            }
            console.print(f"  {mode}, no RL: held-out {score.accuracy:.3f} sampled, {score.greedy:.3f} greedy")
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

    out = report(console, rows, arms, no_rl, warmstarts, plans[arms[0]].env, args.json)
    console.print(f"load average {loads[0][0]:.1f} at start, {loads[-1][0]:.1f} at end, {os.cpu_count()} CPUs")
    # The first arm's plan as run, the command line's overrides included (seed: the last one's).
    plan = plans[arms[0]]
    return {
        **out,
        "plan": {k: getattr(plan, k) for k in plan.__struct_fields__},
        "load_average_1m": [round(x[0], 2) for x in loads],
        "cpus": os.cpu_count(),
    }
