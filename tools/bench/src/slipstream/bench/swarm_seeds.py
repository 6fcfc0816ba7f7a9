"""`slipstream bench swarm-seeds RUN ...`: the swarm demo's runs of several seeds and arms, side by side.

`slipstream demo --env swarm` is one seed of one or two arms (an hour or more on 2 cores); issue
32 asks whether the parallel share and held-out accuracy rise *by a margin justified from the
seed spread*, with the λ = 0 ablation and the single agent beside it. This reads the runs'
`swarm.json` files (a run directory, or the file itself) and prints, per arm (`swarm`,
`swarm-lambda0`, `single`):

- per seed: held-out and train accuracy, perf, parallel rate and sub-agents per episode before ->
  after RL (the run's own evaluation: its warm-start against its last version, same items), and
  the RL batches' parallel turns per episode, mean of the first `--window` steps -> mean of the
  last `--window`;
- across seeds: each change's mean, standard deviation, standard error of the mean (sd / sqrt n)
  and the mean in standard errors, the exact one-sided sign-flip p (the share of the 2^n sign
  assignments of the seeds' changes whose mean reaches the measured one: no normal spread assumed),
  and whether it rose on every seed; with one seed the spread is
  unknown and says so;
- paired, on the seeds both arms ran: λ annealed minus λ = 0 (the rise the auxiliary reward
  adds), and swarm minus single after RL (accuracy, perf, latency per episode);
- the swarm's ceiling where the run measured it: held-out accuracy of the teacher's parallel
  orchestrator over the run's frozen sub-agents (what RL on the orchestrator could reach);
- the accuracy-vs-budget curves, averaged over seeds per arm, N and B.

`--out DIR` writes `swarm-seeds.json` and `swarm-seeds.png` (the batches' parallel turns by
learner step, one line per seed and arm; held-out parallel rate and accuracy before and after per
seed; the mean budget curves). Nothing is run: the runs are the measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path
from typing import Any

# The figures compared before -> after, per split (the evaluation's keys, swarm_eval.FIGURES).
CHANGES = ("accuracy", "perf", "parallel_rate", "subagents", "latency_s")
SPLITS = ("heldout", "train")


def register(bench_subparsers: Any) -> None:
    p = bench_subparsers.add_parser(
        "swarm-seeds",
        help="the swarm demo's runs (seeds x arms) side by side: changes, their seed spread, λ = 0 and single paired",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "runs", nargs="+", type=Path, help="run directories of `slipstream demo --env swarm`, or swarm.json files"
    )
    p.add_argument(
        "--window", type=int, default=10, help="learner steps averaged at the start and the end of RL (default 10)"
    )
    p.add_argument("--out", type=Path, default=None, help="write swarm-seeds.json and swarm-seeds.png here")
    p.set_defaults(func=_command)


def load(path: Path) -> dict[str, Any]:
    """One run's swarm.json (`path`: the file or the run directory holding it)."""
    f = path / "swarm.json" if path.is_dir() else path
    if not f.is_file():
        raise FileNotFoundError(f"bench swarm-seeds: no swarm.json at {path} (a `slipstream demo --env swarm` run dir)")
    report = json.loads(f.read_text())
    if "arms" not in report or "seed" not in report:
        raise ValueError(f"bench swarm-seeds: {f} is not a swarm demo report (no 'arms' or 'seed')")
    report["_path"] = str(f)
    return report


def window_means(curve: list[dict[str, Any]], key: str, window: int) -> tuple[float, float] | None:
    """Mean of `key` over the first and the last `window` learner steps of the batches' curve."""
    values = [float(r[key]) for r in sorted(curve, key=lambda r: r["step"]) if key in r]
    if not values:
        return None
    w = max(1, min(window, len(values)))
    return statistics.fmean(values[:w]), statistics.fmean(values[-w:])


def per_run(report: dict[str, Any], window: int) -> dict[str, dict[str, Any]]:
    """{arm: that arm's figures in this run}: before/after per split and figure, the batches' rise."""
    out: dict[str, dict[str, Any]] = {}
    for arm in report["arms"]:
        row: dict[str, Any] = {"seed": int(report["seed"]), "path": report["_path"]}
        for split in SPLITS:
            before = report.get(f"before/{arm}/{split}") or {}
            after = report.get(f"after/{arm}/{split}") or {}
            for k in CHANGES:
                if k in before and k in after:
                    row[f"{split}/{k}"] = (float(before[k]), float(after[k]))
        # the curve is the swarm arm's (a run holds at most one swarm arm: swarm or swarm-lambda0)
        if arm.startswith("swarm") and report.get("curve"):
            rise = window_means(report["curve"], "parallel_turns", window)
            if rise is not None:
                row["batches/parallel_turns"] = rise
            row["curve"] = [(float(r["step"]), float(r.get("parallel_turns", 0.0))) for r in report["curve"]]
        top = report.get(f"ceiling/{arm}/heldout")
        if top:  # the teacher's parallel orchestrator over this run's frozen sub-agents
            row["ceiling"] = {k: float(top[k]) for k in ("accuracy", "perf") if k in top}
        budget = (report.get("budget_curves") or {}).get(arm)
        if budget:
            row["budget"] = {
                n: {int(p["budget"]): float(p["accuracy"]) for p in points} for n, points in budget["curves"].items()
            }
        out[arm] = row
    return out


def sign_flip_p(deltas: list[float]) -> float | None:
    """One-sided exact sign-flip test that the changes' mean is above 0: the share of the 2^n ways
    of flipping the seeds' signs whose mean is at least the one measured. It assumes only that a
    seed's change is as likely negative as positive when RL does nothing (no normal spread, which a
    handful of 0-1 accuracies does not have); the smallest p it can give is 2^-n (1/64 at 6 seeds,
    1/512 at 9). None for more than 20 seeds (it enumerates) or none at all."""
    n = len(deltas)
    if n == 0 or n > 20:
        return None
    observed = sum(deltas)
    hits = sum(
        1 for mask in range(1 << n) if sum(-d if mask >> i & 1 else d for i, d in enumerate(deltas)) >= observed - 1e-12
    )
    return hits / (1 << n)


def spread(deltas: list[float]) -> dict[str, Any]:
    """Mean, sd, standard error and the mean in standard errors of per-seed changes, and the exact
    one-sided sign-flip p that the mean is above 0."""
    n = len(deltas)
    mean = statistics.fmean(deltas) if deltas else math.nan
    sd = statistics.stdev(deltas) if n >= 2 else None
    if sd is not None and sd < 1e-9:
        sd = 0.0  # equal changes (e.g. two seeds that each gained 5 of 48 episodes): float noise is no spread
    se = sd / math.sqrt(n) if sd is not None else None
    t = mean / se if se else None  # none where there is no spread to measure the mean against
    return {
        "n": n,
        "deltas": [round(d, 4) for d in deltas],
        "mean": round(mean, 4),
        "sd": None if sd is None else round(sd, 4),
        "se": None if se is None else round(se, 4),
        "mean_in_se": None if t is None else round(t, 2),
        "rose_every_seed": n > 0 and all(d > 0 for d in deltas),
        "p_sign_flip": None if (p := sign_flip_p(deltas)) is None else round(p, 4),
    }


def aggregate(reports: list[dict[str, Any]], window: int = 10) -> dict[str, Any]:
    """Every arm's per-seed figures, each change's spread across seeds, the paired comparisons and
    the seed-mean budget curves."""
    arms: dict[str, dict[int, dict[str, Any]]] = {}
    for report in reports:
        for arm, row in per_run(report, window).items():
            seed = row["seed"]
            if seed in arms.setdefault(arm, {}):
                raise ValueError(
                    f"bench swarm-seeds: arm {arm} seed {seed} twice ({arms[arm][seed]['path']} and {row['path']})"
                )
            arms[arm][seed] = row
    result: dict[str, Any] = {"window": window, "arms": {}, "paired": {}}
    for arm, seeds in sorted(arms.items()):
        keys = sorted({k for row in seeds.values() for k in row if "/" in k and k != "path"})
        changes = {}
        for k in keys:
            pairs = {s: row[k] for s, row in sorted(seeds.items()) if k in row}
            changes[k] = {
                "per_seed": {str(s): [round(a, 4), round(b, 4)] for s, (a, b) in pairs.items()},
                **spread([b - a for a, b in pairs.values()]),
            }
        tops = {str(s): row["ceiling"] for s, row in sorted(seeds.items()) if "ceiling" in row}
        result["arms"][arm] = {
            "seeds": sorted(seeds),
            "changes": changes,
            "ceiling_heldout": {
                "per_seed": tops,
                "accuracy_mean": round(statistics.fmean(t["accuracy"] for t in tops.values()), 4) if tops else None,
            },
            "budget_mean": _budget_mean([row["budget"] for row in seeds.values() if "budget" in row]),
        }

    def paired(a: str, b: str, keys: tuple[str, ...], after_only: bool) -> dict[str, Any]:
        common = sorted(set(arms.get(a, {})) & set(arms.get(b, {})))
        out: dict[str, Any] = {}
        for k in keys:
            diffs = []
            for s in common:
                ra, rb = arms[a][s].get(k), arms[b][s].get(k)
                if ra is None or rb is None:
                    continue
                # after RL (swarm vs single), or the change during RL (λ annealed vs λ = 0)
                diffs.append(ra[1] - rb[1] if after_only else (ra[1] - ra[0]) - (rb[1] - rb[0]))
            if diffs:
                out[k] = spread(diffs)
        return {"seeds": common, **out} if common else {}

    lam = paired(
        "swarm", "swarm-lambda0", ("batches/parallel_turns", "heldout/parallel_rate", "heldout/accuracy"), False
    )
    if lam:
        result["paired"]["swarm - swarm-lambda0 (change during RL)"] = lam
    single = paired("swarm", "single", ("heldout/accuracy", "heldout/perf", "heldout/latency_s"), True)
    if single:
        result["paired"]["swarm - single (after RL)"] = single
    result["curves"] = {arm: {str(s): row.get("curve", []) for s, row in seeds.items()} for arm, seeds in arms.items()}
    return result


def _budget_mean(curves: list[dict[str, dict[int, float]]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for n in sorted({n for c in curves for n in c}, key=int):
        budgets = sorted({b for c in curves if n in c for b in c[n]})
        out[n] = {
            str(b): {
                "mean": round(statistics.fmean(vals), 4),
                "sd": round(statistics.stdev(vals), 4) if len(vals) > 1 else None,
                "min": round(min(vals), 4),
                "max": round(max(vals), 4),
                "per_seed": [round(v, 4) for v in vals],
            }
            for b in budgets
            if (vals := [c[n][b] for c in curves if n in c and b in c[n]])
        }
    return out


def _fmt(s: dict[str, Any]) -> str:
    if s["sd"] is None:
        return f"{s['mean']:+.3f} (one seed: spread unknown)"
    every = "every seed rose" if s["rose_every_seed"] else "not every seed rose"
    if s["mean_in_se"] is None:
        return f"{s['mean']:+.3f} (sd 0: every seed changed alike, no spread to weigh it against; {every})"
    p = s.get("p_sign_flip")
    sign = "" if p is None else f", sign-flip p {p:.3f}"
    return f"{s['mean']:+.3f} (sd {s['sd']:.3f}, se {s['se']:.3f}, {s['mean_in_se']} se{sign}; {every})"


def tables(result: dict[str, Any]) -> list[Any]:
    """Rich tables: one per arm (seed rows, change columns), the budget curves' seed means and spread,
    one for the paired comparisons."""
    from rich.table import Table

    shown = ("heldout/parallel_rate", "batches/parallel_turns", "heldout/accuracy", "heldout/perf", "heldout/subagents")
    out = []
    for arm, a in result["arms"].items():
        t = Table(title=f"{arm}: before -> after RL, per seed", title_justify="left")
        t.add_column("seed")
        cols = [k for k in shown if k in a["changes"]]
        for k in cols:
            t.add_column(k)
        for s in a["seeds"]:
            cells = []
            for k in cols:
                v = a["changes"][k]["per_seed"].get(str(s))
                cells.append(f"{v[0]:.3f} -> {v[1]:.3f}" if v else "-")
            t.add_row(str(s), *cells)
        t.add_row("change", *(_fmt(a["changes"][k]) for k in cols))
        out.append(t)
    curves = [(arm, n, pts) for arm, a in result["arms"].items() for n, pts in a["budget_mean"].items()]
    if curves:
        t = Table(
            title="held-out accuracy vs critical-step budget B after RL: seed mean (sd; seeds)", title_justify="left"
        )
        budgets = sorted({int(b) for _, _, pts in curves for b in pts})
        for col in ("arm", "N", *(f"B={b}" for b in budgets)):
            t.add_column(col)
        for arm, n, pts in curves:
            cells = []
            for b in budgets:
                p = pts.get(str(b))
                sd = "-" if p is None or p["sd"] is None else f"{p['sd']:.3f}"
                cells.append("" if p is None else f"{p['mean']:.3f} ({sd}; {len(p['per_seed'])})")
            t.add_row(arm, n, *cells)
        out.append(t)
    if result["paired"]:
        t = Table(title="paired on the seeds both arms ran", title_justify="left")
        for col in ("comparison", "seeds", "figure", "difference"):
            t.add_column(col)
        for name, p in result["paired"].items():
            for k, s in p.items():
                if k != "seeds":
                    t.add_row(name, ",".join(map(str, p["seeds"])), k, _fmt(s))
        out.append(t)
    return out


def ceiling_lines(result: dict[str, Any]) -> list[str]:
    """One line per arm whose runs measured the ceiling: held-out accuracy per seed."""
    lines = []
    for arm, a in result["arms"].items():
        tops = a["ceiling_heldout"]["per_seed"]
        if tops:
            acc = ", ".join(f"seed {s} {v.get('accuracy', 0.0):.3f}" for s, v in tops.items())
            lines.append(
                f"{arm} ceiling (the teacher in parallel over the run's frozen sub-agents), held-out accuracy: {acc}"
            )
    return lines


def plot(result: dict[str, Any], path: Path) -> Path:
    """Batches' parallel turns by learner step (a line per seed and arm); held-out parallel rate and
    accuracy before and after (a segment per seed and arm); the seed-mean budget curves."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    colours = {"swarm": "tab:blue", "swarm-lambda0": "tab:orange", "single": "tab:green"}
    ax = axes[0]
    for arm, per_seed in result["curves"].items():
        for i, (_seed, curve) in enumerate(sorted(per_seed.items())):
            if curve:
                ax.plot(
                    [c[0] for c in curve],
                    [c[1] for c in curve],
                    color=colours.get(arm),
                    alpha=0.7,
                    lw=1,
                    label=arm if i == 0 else None,
                )
    ax.set_title("RL batches: parallel turns per episode\n(one line per seed)")
    ax.set_xlabel("learner step")
    for ax, key, title in (
        (axes[1], "heldout/parallel_rate", "held-out parallel rate\n(share of episodes with a parallel turn)"),
        (axes[2], "heldout/accuracy", "held-out accuracy at the budget\n(every document found)"),
    ):
        for j, (arm, a) in enumerate(result["arms"].items()):
            ch = a["changes"].get(key)
            if not ch:
                continue
            for i, (_, (b, af)) in enumerate(sorted(ch["per_seed"].items())):
                x = j * 0.1
                ax.plot(
                    [x, 1 + x], [b, af], marker="o", color=colours.get(arm), alpha=0.7, label=arm if i == 0 else None
                )
        ax.set_xticks([0, 1], ["before RL", "after RL"])
        ax.set_title(title)
    ax = axes[3]
    for arm, a in result["arms"].items():
        for n, points in a["budget_mean"].items():
            bs = sorted(points, key=int)
            xs = [int(b) for b in bs]
            (line,) = ax.plot(
                xs,
                [points[b]["mean"] for b in bs],
                marker="o" if n == "4" else "s",
                linestyle="-" if n == "4" else "--",
                color=colours.get(arm),
                label=f"{arm} N={n} (mean of {len(points[bs[0]]['per_seed'])} seeds)",
            )
            # the seeds' range at each budget: where one seed is all there is, the band is the line
            lo, hi = [points[b]["min"] for b in bs], [points[b]["max"] for b in bs]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.12, linewidth=0)
    ax.set_title("held-out accuracy vs critical-step budget B\n(after RL, seed mean; band: the seeds' range)")
    ax.set_xlabel("B")
    if not ax.lines:  # runs made with --swarm-budget-tasks 0 have no curve: say so on the panel
        ax.text(0.5, 0.5, "no budget curve in these runs\n(--swarm-budget-tasks 0)", ha="center", va="center")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("slipstream demo --env swarm over seeds (bench swarm-seeds)")
    fig.tight_layout()
    from slipstream.run.report_figure import save

    return save(fig, path, dpi=100)


def _command(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    # the per-seed tables are wide: when written to a file or a pipe, do not fold them to 80 columns
    console = Console(width=None if sys.stdout.isatty() else 200)
    try:
        reports = [load(p) for p in args.runs]
        result = aggregate(reports, args.window)
    except (FileNotFoundError, ValueError) as exc:
        console.print(f"[red]{exc}[/red]")
        return 2
    for t in tables(result):
        console.print(t)
    for text in ceiling_lines(result):
        console.print(text, soft_wrap=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "swarm-seeds.json").write_text(json.dumps(result, indent=1))
        console.print(f"wrote {args.out / 'swarm-seeds.json'} and {plot(result, args.out / 'swarm-seeds.png')}")
    return 0
