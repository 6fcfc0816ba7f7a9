"""A finished run as an HTML page and PNG plots, readable offline (`slipstream report RUN --out DIR`).

From the run directory it reads `summary.json` (what `slipstream demo` writes; without it, the
learner's `step` log lines), the services' JSON logs under `logs/`, and the span files when the
stack ran with `--traces` (named in `stack.json`). It plots the learner's batch reward and
accuracy per step (sampled rollouts; with held-out accuracy, sampled and greedy, where it was
measured), the staleness distribution, throughput per service over time, time-to-policy per
version, where time went per stage (summed and as wall-clock cover), and per step the
train–inference mismatch, the share of tokens the off-policy mask removed and the KL to the
reference (when the learner reported them). A plot whose data is
missing is skipped with a note saying why. `DIR/report.json` holds every plotted series, so a
script or a test can check what was drawn.
"""

from __future__ import annotations

import argparse
import html
import json
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from slipstream.run.report_figure import Panel, Plot, Series, draw
from slipstream.stack.spec import HOME

# ---- reading the run ----


@dataclass
class Run:
    run_dir: Path
    summary: dict[str, Any]
    steps: list[dict[str, Any]]
    steps_source: str
    logs: dict[str, list[dict[str, Any]]]
    spans: list[dict[str, Any]]
    span_files: list[Path]
    notes: list[str]


def resolve_run(raw: str) -> Path:
    path = Path(raw)
    if not path.exists() and (HOME / "runs" / raw).is_dir():
        path = HOME / "runs" / raw
    if not path.is_dir():
        raise ReportError(f"no run directory {raw!r} (give a path, or a run id under {HOME / 'runs'})")
    return path.resolve()


class ReportError(Exception):
    """The run cannot be reported on (no such directory, no steps anywhere)."""


def read_logs(log_dir: Path) -> tuple[dict[str, list[dict[str, Any]]], int]:
    """JSON log lines per service (file stem), and how many lines were something else.

    Services log JSON lines; anything else (a traceback printed before logging was set up, a
    server's own log format) is skipped and counted.
    """
    out: dict[str, list[dict[str, Any]]] = {}
    skipped = 0
    for path in sorted(log_dir.glob("*.log")) if log_dir.is_dir() else []:
        rows: list[dict[str, Any]] = []
        other = 0
        for line in path.read_text(errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                row = json.loads(line) if line.startswith("{") else None
            except ValueError:
                row = None
            if isinstance(row, dict):
                rows.append(row)
            else:
                other += 1
        if rows:  # a file without one JSON line is a server's own log (nats, redis), not a service's
            out[path.stem] = rows
            skipped += other
    return out, skipped


def _ts(row: dict[str, Any]) -> float | None:
    try:
        return datetime.fromisoformat(str(row["timestamp"])).timestamp()
    except (KeyError, ValueError):
        return None


# Episode shape the learner logs with each step (slipstream.rl.credit.episode_figures).
EPISODE_FIGURES = ("turns_per_episode", "tool_calls_per_turn", "invalid_call_rate", "samples_per_episode")
STEP_MAPS = ("reward_weights", "episode_means")
# Per-step loss figures of learner.step and the step log line (kl is None on a step without a reference).
LOSS_FIGURES = ("mismatch_kl", "masked_share", "kl")


def steps_from_logs(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The learner's `step` log lines in the shape of summary.json's steps_log."""
    steps = [r for r in rows if r.get("event") == "step" and "step" in r]
    t0 = min((_ts(r) or 0.0 for r in steps), default=0.0)
    return [
        {
            "step": int(r["step"]),
            "version": int(r.get("policy_version", r["step"])),
            "reward": float(r.get("reward_mean", 0.0)),
            "accuracy": float(r.get("accuracy", 0.0)),
            "trajectories": int(r.get("n_trajectories", 0)),
            "staleness": {str(k): int(v) for k, v in (r.get("staleness") or {}).items()},
            "step_time_s": float(r.get("time_s", 0.0)),
            "t": (_ts(r) or t0) - t0,
            **{k: float(r[k]) for k in EPISODE_FIGURES if k in r},
            # λ of the reward schedule and the per-step swarm means (learner.step's reward_weights, episode_means).
            **{k: {str(n): float(v) for n, v in r[k].items()} for k in STEP_MAPS if isinstance(r.get(k), dict)},
            **{k: float(r[k]) for k in LOSS_FIGURES if isinstance(r.get(k), (int, float))},
        }
        for r in steps
    ]


def load_run(run_dir: Path, traces: list[Path]) -> Run:
    from slipstream.telemetry.spanfile import read_spans

    notes: list[str] = []
    summary: dict[str, Any] = {}
    if (run_dir / "summary.json").exists():
        summary = json.loads((run_dir / "summary.json").read_text())
    logs, skipped = read_logs(run_dir / "logs")
    if skipped:
        notes.append(f"{skipped} log lines were not JSON objects and were skipped")
    steps, source = list(summary.get("steps_log") or []), "summary.json"
    if not steps:
        steps, source = steps_from_logs(logs.get("learner", [])), "logs/learner.log"
    if not steps:
        raise ReportError(
            f"{run_dir} has no learner steps (no summary.json steps_log, no `step` lines in logs/learner.log)"
        )
    steps.sort(key=lambda s: s["step"])
    files = list(traces)
    if not files and (run_dir / "stack.json").exists():
        from slipstream.stack.stackfile import StackFileError, read_stack_file

        try:
            services = read_stack_file(run_dir).services
        except StackFileError as exc:
            services = {}
            notes.append(f"span files not found: {exc}")
        files = [Path(s.traces_file) for s in services.values() if s.traces_file]
    files = [f for f in files if f.exists()]
    spans, bad = read_spans(files) if files else ([], 0)
    if bad:
        notes.append(f"{bad} span lines could not be read and were skipped")
    return Run(run_dir, summary, steps, source, logs, spans, files, notes)


# ---- what to plot ----


# The reward plot's series. The learner's figures are over the batch it trained on (sampled rollouts
# of train-split tasks, uniform groups dropped), not an evaluation; held-out is both ways.
BATCH_REWARD = "batch reward (sampled, mean per learner step)"
BATCH_ACCURACY = "batch accuracy (sampled, the groups each step trained on)"
HELDOUT_SAMPLED = "held-out accuracy, sampled"
HELDOUT_GREEDY = "held-out accuracy, greedy"


def _sampling(summary: dict[str, Any]) -> str:
    """How the held-out evaluation sampled, from the run's plan: "T=1, 4 samples per task"."""
    plan = summary.get("plan") or {}
    if "temperature" not in plan:
        return "at the rollout temperature"
    return f"T={float(plan['temperature']):g}, {int(plan.get('heldout_samples', 1))} samples per task"


def reward_plot(run: Run) -> Plot:
    xs = [float(s["step"]) for s in run.steps]
    series: dict[str, Series] = {
        BATCH_REWARD: {"x": xs, "y": [float(s["reward"]) for s in run.steps]},
        BATCH_ACCURACY: {"x": xs, "y": [float(s["accuracy"]) for s in run.steps]},
    }
    # Held-out accuracy by the step that produced the evaluated version (version 0: before RL).
    step_of = {0: 0.0, **{int(s["version"]): float(s["step"]) for s in run.steps}}
    sampled: dict[float, float] = {}
    greedy: dict[float, float] = {}
    for e in run.summary.get("eval_curve") or []:
        at = step_of.get(int(e["version"]), float(e["version"]))
        sampled[at] = float(e["accuracy"])
        if "greedy" in e:
            greedy[at] = float(e["greedy"])
    s = run.summary
    # The summary's before/after figures fill in where the curve lacks them; greedy only where the
    # curve has greedy figures at all (a curve without them is from a run that did not record them).
    filled = [(sampled, "heldout_accuracy")] + ([(greedy, "heldout_greedy")] if greedy else [])
    if s.get("heldout_tasks"):
        last = step_of.get(int(s.get("final_version", -1)), xs[-1])
        for held, key in filled:
            held.setdefault(0.0, float(s.get(f"{key}_before", 0.0)))
            if s.get("ok"):
                held.setdefault(last, float(s.get(f"{key}_after", 0.0)))
    for name, held in ((HELDOUT_SAMPLED, sampled), (HELDOUT_GREEDY, greedy)):
        if held:
            series[name] = {"x": sorted(held), "y": [held[k] for k in sorted(held)]}
    caption = (
        f"Per learner step ({len(xs)} steps, from {run.steps_source}): the mean reward and the accuracy of the batch "
        "it trained on, sampled rollouts of train-split tasks; groups whose rewards were all equal are dropped before "
        "a step, so these run above what the policy scores on fresh tasks."
    )
    if sampled:
        caption += (
            f" Held-out accuracy where it was measured (before RL at step 0, during, and after): sampled "
            f"({_sampling(s)}) and greedy."
        )
    return Plot(
        "reward",
        "Reward and accuracy per step",
        caption,
        [Panel("the learner's batch (sampled) and held-out evaluations", "learner step", "value", "line", series)],
    )


def staleness_plot(run: Run) -> Plot:
    total: dict[int, int] = {}
    means: list[float] = []
    for s in run.steps:
        hist = {int(k): int(v) for k, v in (s.get("staleness") or {}).items()}
        for k, v in hist.items():
            total[k] = total.get(k, 0) + v
        n = sum(hist.values())
        means.append(sum(k * v for k, v in hist.items()) / n if n else 0.0)
    lags = list(range(max(total) + 1)) if total else []
    return Plot(
        "staleness",
        "Staleness",
        "How many versions behind the learner each trained trajectory was: over the whole run, and the mean per step.",
        [
            Panel(
                "distribution", "versions behind", "trajectories", "bar",
                {"trajectories": {"x": [float(k) for k in lags], "y": [float(total.get(k, 0)) for k in lags]}},
            ),
            Panel(
                "mean per step", "learner step", "versions behind", "line",
                {"mean staleness": {"x": [float(s["step"]) for s in run.steps], "y": means}},
            ),
        ],
    )  # fmt: skip


def throughput_plot(run: Run) -> Plot:
    from slipstream.telemetry.trace_stats import throughput

    panels: list[Panel] = []
    starts, rates = throughput(run.spans)
    if rates:
        panels.append(
            Panel(
                "messages handled per second (from traces)", "seconds since the first span", "messages/s", "line",
                {svc: {"x": starts, "y": ys} for svc, ys in rates.items()},
            )
        )  # fmt: skip
    xs, ys, prev = [], [], 0.0
    for s in run.steps:
        t = float(s.get("t", 0.0))
        if t > prev:
            xs.append(t)
            ys.append(float(s["trajectories"]) / (t - prev))
        prev = max(prev, t)
    if xs:
        panels.append(
            Panel(
                "learner: trajectories trained per second", "seconds since training began", "trajectories/s", "line",
                {"learner": {"x": xs, "y": ys}},
            )
        )  # fmt: skip
    note = "" if rates else " No span files, so only the learner's rate (from its steps) is shown."
    return Plot(
        "throughput", "Throughput per service", "Messages each service handled per second over the run." + note, panels
    )


def time_to_policy_plot(run: Run) -> Plot:
    """Per version: learner step logged -> announced by the publisher -> first applied by a worker."""
    stepped: dict[int, float] = {}
    announced: dict[int, float] = {}
    applied: dict[int, float] = {}
    for service, rows in run.logs.items():
        for r in rows:
            t, v = _ts(r), r.get("policy_version")
            if t is None or not isinstance(v, int):
                continue
            ev = r.get("event")
            target = (
                stepped if (service == "learner" and ev == "step")
                else announced if (service.startswith("weight-publisher") and ev == "announced")
                else applied if (service.startswith("rollout-worker") and ev == "applied weights")
                else None
            )  # fmt: skip
            if target is not None:
                target[v] = min(t, target.get(v, t))
    versions = sorted(v for v in stepped if v in applied)
    panels = []
    if versions:
        series: dict[str, Series] = {
            "step -> first worker applied": {
                "x": [float(v) for v in versions],
                "y": [applied[v] - stepped[v] for v in versions],
            }
        }
        pub = [v for v in versions if v in announced]
        if pub:
            series["step -> announced"] = {"x": [float(v) for v in pub], "y": [announced[v] - stepped[v] for v in pub]}
        panels.append(Panel("seconds after the learner's step", "policy version", "seconds", "line", series))
    return Plot(
        "time_to_policy",
        "Time to policy per version",
        "Seconds from the learner logging a step to the weight publisher announcing its version and to the first "
        "rollout worker applying it (from the services' log timestamps; the worker samples with it from then on).",
        panels,
    )


def mismatch_plot(run: Run) -> Plot:
    """Per learner step: the train–inference mismatch, the off-policy mask's share, and the KL to the reference."""

    def series(key: str) -> Series:
        rows = [s for s in run.steps if isinstance(s.get(key), (int, float))]
        return {"x": [float(s["step"]) for s in rows], "y": [float(s[key]) for s in rows]}

    panels = []
    mismatch, masked, kl = series("mismatch_kl"), series("masked_share"), series("kl")
    if mismatch["y"]:
        panels.append(
            Panel(
                "train–inference mismatch: KL(behaviour ‖ learner) per trained token", "learner step",
                "k3 estimate of KL per token", "line", {"mismatch": mismatch},
            )
        )  # fmt: skip
    if masked["y"]:
        panels.append(
            Panel(
                "share of trained tokens the off-policy mask removed", "learner step", "masked share (0-1)", "line",
                {"masked share": masked},
            )
        )  # fmt: skip
    if kl["y"]:
        panels.append(
            Panel(
                "KL(policy ‖ frozen reference) per trained token", "learner step", "KL per token ([loss] kl_estimator)",
                "line", {"KL to the reference": kl},
            )
        )  # fmt: skip
    return Plot(
        "mismatch",
        "Train–inference mismatch and off-policy masking per step",
        "Per learner step, before its update: the k3 estimate of KL(π_behaviour ‖ π_learner) per trained token, "
        "from the log-probs the workers recorded while sampling against the learner's recomputed ones (0 = no "
        "mismatch; in an asynchronous run it also holds the drift of the versions a trajectory lags, not only "
        "numerical differences); the share of trained tokens [loss] off_policy_mask removed from the loss (0 with the "
        "mask off); "
        "and, when [loss] kl_coef > 0, the mean per-token KL of the policy to its frozen reference.",
        panels if mismatch["y"] or masked["y"] else [],
    )


STAGE_SUM = "sum of span durations (concurrent spans each count)"
STAGE_BUSY = "wall-clock seconds with one open (overlaps once)"


def stages_plot(run: Run) -> Plot:
    from slipstream.telemetry.trace_stats import time_by_stage

    stages = time_by_stage(run.spans)[:20]
    panels = []
    if stages:
        ys = [float(i) for i in range(len(stages))]
        panels.append(
            Panel(
                "seconds per stage (a service's outermost spans of one name)", "seconds", "", "barh",
                {STAGE_SUM: {"x": ys, "y": [s.total_s for s in stages]},
                 STAGE_BUSY: {"x": ys, "y": [s.busy_s for s in stages]}},
                labels=[f"{s.service}: {s.name} (x{s.count})" for s in stages],
            )
        )  # fmt: skip
    return Plot(
        "stages",
        "Where time went per stage",
        "Per stage (one service's outermost spans of one name: handling a message, a step, a publish), two "
        "figures over the run: the sum of the spans' durations, in which spans open at the same time each count "
        "(a worker handling 8 messages at once for 10 s sums 80 s, so a stage's sum can exceed the run's wall "
        "time), and the wall-clock seconds in which at least one of them was open (overlaps counted once).",
        panels,
    )


# ---- writing (the drawing: report_figure.py) ----


def _summary_rows(run: Run) -> list[tuple[str, str]]:
    s, tr = run.summary, run.summary.get("trajectories") or {}
    rows = [("run", run.run_dir.name), ("learner steps", str(len(run.steps))), ("steps from", run.steps_source)]
    if s:
        rows += [
            ("result", "ok" if s.get("ok") else f"FAILED: {s.get('error', '')[:200]}"),
            (f"held-out accuracy before (v0) / after (v{s.get('final_version', 0)}), sampled",
             f"{s.get('heldout_accuracy_before', 0):.3f} / {s.get('heldout_accuracy_after', 0):.3f} "
             f"({s.get('heldout_tasks', 0)} tasks, {_sampling(s)})"),
            (f"held-out accuracy before (v0) / after (v{s.get('final_version', 0)}), greedy",
             f"{s.get('heldout_greedy_before', 0):.3f} / {s.get('heldout_greedy_after', 0):.3f}"),
            ("versions published", f"{s.get('versions_published', 0)} (final v{s.get('final_version', 0)})"),
            ("trajectories published / scored / trained",
             f"{tr.get('published', '-')} / {tr.get('scored', '-')} / {tr.get('trained', '-')}"),
            ("dropped", ", ".join(f"{k} {v}" for k, v in sorted((tr.get("dropped") or {}).items())) or "none"),
            ("training / wall time", f"{s.get('train_time_s', 0):.0f} s / {s.get('wall_time_s', 0):.0f} s"),
        ]  # fmt: skip
    shaped = [st for st in run.steps if "turns_per_episode" in st]
    if shaped:
        first, last = shaped[0], shaped[-1]

        def fig(step: dict[str, Any], key: str) -> str:
            # A figure the step did not carry (a summary written before it was recorded) is unknown, not 0.
            return f"{float(step[key]):.3f}" if isinstance(step.get(key), (int, float)) else "-"

        rows.append(
            (
                "episodes, first / last step",
                " | ".join(
                    f"{k.replace('_', ' ')} {fig(first, k)} / {fig(last, k)}"
                    for k in EPISODE_FIGURES
                    if k in first or k in last
                ),
            )
        )
    rows.append(("span files", str(len(run.span_files)) + f" ({len(run.spans)} spans)"))
    return rows


def write_html(run: Run, drawn: list[Plot], skipped: dict[str, str], path: Path) -> None:
    esc = html.escape
    table = "\n".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in _summary_rows(run))
    figures = "\n".join(
        f'<h2>{esc(p.title)}</h2>\n<img src="{esc(p.name)}.png" alt="{esc(p.title)}">\n<p>{esc(p.caption)}</p>'
        for p in drawn
    )
    missing = "".join(f"<li><b>{esc(n)}</b>: {esc(why)}</li>" for n, why in skipped.items())
    notes = "".join(f"<li>{esc(n)}</li>" for n in run.notes)
    path.write_text(
        f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Slipstream run {esc(run.run_dir.name)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}}
table{{border-collapse:collapse}}th,td{{border:1px solid #ccc;padding:4px 10px;text-align:left}}
img{{max-width:100%;border:1px solid #eee}}</style></head><body>
<h1>Slipstream run {esc(run.run_dir.name)}</h1>
<p>{esc(str(run.run_dir))} · report written {esc(time.strftime("%Y-%m-%d %H:%M:%S"))}</p>
<table>{table}</table>
{figures}
{f"<h2>Not plotted</h2><ul>{missing}</ul>" if missing else ""}
{f"<h2>Notes</h2><ul>{notes}</ul>" if notes else ""}
</body></html>
"""
    )


def build_report(
    run_dir: Path, out: Path, traces: list[Path] | None = None, *, pictures: bool = True
) -> dict[str, Any]:
    """Write out/index.html, out/<plot>.png and out/report.json (only the JSON without `pictures`).

    Returns what report.json holds.
    """
    run = load_run(run_dir, list(traces or []))
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        reward_plot(run),
        staleness_plot(run),
        mismatch_plot(run),
        throughput_plot(run),
        time_to_policy_plot(run),
        stages_plot(run),
    ]
    reasons = {
        "time_to_policy": "no version was both stepped by the learner and applied by a rollout worker in the logs",
        "stages": "no span files; start the stack with --traces FILE (or pass --traces to the report)",
        "throughput": "no span files and no step timings",
        "staleness": "no staleness histogram in the steps",
        "mismatch": "no mismatch_kl or masked_share in the steps (a learner from before it reported them)",
    }
    drawn, skipped = [], {}
    for p in plots:
        if not p.panels or not any(s["y"] for panel in p.panels for s in panel.series.values()):
            skipped[p.name] = reasons.get(p.name, "no data")
            continue
        if pictures:
            draw(p, out / f"{p.name}.png")
        drawn.append(p)
    if pictures:
        write_html(run, drawn, skipped, out / "index.html")
    result = {
        "run_dir": str(run.run_dir),
        "steps": len(run.steps),
        "steps_source": run.steps_source,
        "span_files": [str(f) for f in run.span_files],
        "spans": len(run.spans),
        "plots": {
            p.name: {
                "file": f"{p.name}.png",
                "title": p.title,
                "panels": [
                    {"title": pa.title, "kind": pa.kind, "series": pa.series, "labels": pa.labels} for pa in p.panels
                ],
            }
            for p in drawn
        },
        "skipped": skipped,
        "notes": run.notes,
    }
    (out / "report.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def run(args: argparse.Namespace) -> int:
    try:
        run_dir = resolve_run(args.run)
        out = args.out or run_dir / "report"
        result = build_report(run_dir, out, args.traces, pictures=not args.json_only)
    except ReportError as exc:
        print(f"slipstream report: {exc}")
        return 1
    page = out / ("report.json" if args.json_only else "index.html")
    print(f"report of {result['steps']} steps: {page} ({len(result['plots'])} plots)")
    for name, why in result["skipped"].items():
        print(f"  skipped {name}: {why}")
    return 0
