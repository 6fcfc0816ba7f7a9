"""The demo's live progress view and its closing summary table (rich).

`ProgressView.on_event(kind, data)` receives what `run_training` reports (phases, warm-start
figures, learner steps, versions, held-out evals, log lines) and redraws a small dashboard:
step, reward, train accuracy, held-out accuracy, versions, staleness and throughput. Without a
terminal (or with live=False) it prints one line per event instead.
"""

from __future__ import annotations

import time
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 40) -> str:
    if not values:
        return ""
    vals = values[-width:]
    lo, hi = min(vals), max(vals)
    span = (hi - lo) or 1.0
    return "".join(BARS[min(len(BARS) - 1, int((v - lo) / span * (len(BARS) - 1)))] for v in vals)


class ProgressView:
    def __init__(self, console: Console, plan: Any, *, live: bool = True) -> None:
        self.console = console
        self.plan = plan
        self.live_enabled = live and console.is_terminal
        self.phase = "starting"
        self.detail = ""
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, float]] = []
        self.version = 0
        self.restarts: dict[str, int] = {}
        self.t0 = time.monotonic()
        self._check_shown_at = time.monotonic()  # the last warm-start probe line (see on_event)
        self._check_greedy = 0.0
        self._live: Live | None = None

    def __enter__(self) -> ProgressView:
        if self.live_enabled:
            self._live = Live(self.render(), console=self.console, refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.update(self.render())
            self._live.__exit__(None, None, None)

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "phase":
            self.phase, self.detail = data["phase"], data.get("detail", "")
            self._line(f"[bold]{self.phase}[/bold]: {self.detail}")
        elif kind == "warmstart" and "model" in data:
            self._line(f"model: {data['model']} from {data.get('path')} ({data.get('resolve_s', 0):.1f} s)")
        elif kind == "warmstart" and "steps" not in data:
            pass  # a given initial model (--init-model): the phase line named it
        elif kind == "warmstart":
            if "copy" in data:
                c = data["copy"]
                self._line(
                    f"copy curriculum: {c['steps']} steps in {c['seconds']:.1f} s, exact copies "
                    f"{c['copy_accuracy']:.3f}" + ("" if c["reached"] else " (target not reached)")
                )
            self._line(
                f"warm-start: {data.get('steps')} steps in {data.get('seconds', 0):.1f} s, "
                f"loss {data.get('loss_first', 0):.2f} -> {data.get('loss_last', 0):.2f}"
                + (f", greedy train accuracy {data['probe_accuracy']:.3f}" if "probe_accuracy" in data else "")
                + (f", expected sampled success {data['probe_sampled']:.3f}" if "probe_sampled" in data else "")
            )
        elif kind == "warmstart_check":
            # A probe check every few steps: a line at most every 30 s, or when greedy replay moved
            # by 0.1 (the supervised cliff), so a warm-start of minutes shows where it is.
            now = time.monotonic()
            if now - self._check_shown_at >= 30.0 or abs(data["greedy"] - self._check_greedy) >= 0.1:
                self._check_shown_at, self._check_greedy = now, data["greedy"]
                sampled = f", expected sampled success {data['sampled']:.3f}" if data["sampled"] >= 0 else ""
                self._line(f"warm-start step {data['step']}: greedy train accuracy {data['greedy']:.3f}{sampled}")
        elif kind == "step":
            self.steps.append(data)
            self.phase, self.detail = "train", f"step {data['step']}/{self.plan.max_steps}"
            if not self.live_enabled:
                self._line(
                    f"step {data['step']:>4}  v{data['version']:<4} reward {data['reward']:.3f}  "
                    f"acc {data['accuracy']:.3f}  loss {data['loss']:+.4f}  staleness {data['staleness']}"
                )
        elif kind == "version":
            self.version = max(self.version, int(data["version"]))
        elif kind == "eval":
            self.evals.append(data)
            extra = f", invalid calls {data['invalid_call_rate']:.3f}" if data.get("invalid_call_rate") else ""
            if "train_accuracy" in data:
                train, train_greedy = data["train_accuracy"], data.get("train_greedy", -1.0)
                extra += f"; train split {train:.3f} sampled, {train_greedy:.3f} greedy"
            self._line(
                f"held-out accuracy of v{int(data['version'])}: {data['accuracy']:.3f} sampled, "
                f"{data.get('greedy', 0.0):.3f} greedy{extra}"
            )
        elif kind == "supervisor":
            # Crashes, restarts and give-ups are shown in the live view too (without it, the stack's
            # own log line says the same).
            if data["kind"] == "restarted":
                self.restarts[data["service"]] = int(data["restarts"])
            shown = data["kind"] in ("crashed", "gave_up", "restarted")
            if self.live_enabled and shown:
                what = data["kind"].replace("_", " ")
                detail = data["detail"] or f"restart {data['restarts']}"
                self._line(f"[yellow]{data['service']} {what}[/yellow] ({detail})")
        elif kind == "log" and not self.live_enabled:
            self.console.print(f"[dim]·[/dim] {data['message']}")
        if self._live is not None:
            self._live.update(self.render())

    def _line(self, text: str) -> None:
        self.console.print(text)

    def render(self) -> Group:
        t = Table(title=f"slipstream demo — {self.phase} {self.detail}", expand=False)
        # batch reward / acc: the learner's step, over the groups it trained on (uniform groups are
        # dropped, so these run above what the policy scores on fresh tasks: compare train vs held-out).
        cols = ("step", "version", "batch reward", "batch acc", "train acc", "held-out acc", "staleness", "traj/s")
        for col in (*cols, "elapsed"):
            t.add_column(col, justify="right")
        last = self.steps[-1] if self.steps else None
        ev = self.evals[-1] if self.evals else None
        held = f"{ev['accuracy']:.3f} (v{int(ev['version'])})" if ev else "-"
        train = f"{ev['train_accuracy']:.3f}" if ev and "train_accuracy" in ev else "-"
        if last is not None:
            trained = sum(s["trajectories"] for s in self.steps)
            rate = trained / max(1e-6, last["t"]) if last["t"] else 0.0
            stale = last["staleness"]
            t.add_row(
                f"{last['step']}/{self.plan.max_steps}",
                str(self.version),
                f"{last['reward']:.3f}",
                f"{last['accuracy']:.3f}",
                train,
                held,
                " ".join(f"{k}:{v}" for k, v in sorted(stale.items())) or "-",
                f"{rate:.1f}",
                f"{time.monotonic() - self.t0:.0f} s",
            )
        else:
            t.add_row("-", str(self.version), "-", "-", train, held, "-", "-", f"{time.monotonic() - self.t0:.0f} s")
        rewards = [s["reward"] for s in self.steps]
        spark = Text(f"reward  {sparkline(rewards)}\n")
        spark.append(f"held-out {sparkline([e['accuracy'] for e in self.evals], 20)}")
        if self.restarts:
            spark.append("\nrestarts " + ", ".join(f"{k} {v}" for k, v in sorted(self.restarts.items())))
        return Group(t, spark)


def weights_line(w: dict[str, Any]) -> str:
    if not w or not w.get("full_snapshot_bytes"):
        return "-"
    mb = 1e6
    return (
        f"{w['stored_bytes'] / mb:.1f} MB vs {w['full_snapshot_bytes'] / mb:.1f} MB "
        f"({w['stored_fraction']:.1%}; deltas {w['delta_stored_fraction']:.1%}, {w['keyframes']} keyframes)"
    )


def _calls_tools(env: str) -> bool:
    """Whether `env` scores invalid tool calls, so its invalid-call rate is worth a row even at 0."""
    from slipstream.envs import ENVIRONMENTS

    cls = ENVIRONMENTS.get(env)
    return cls is not None and "invalid_call" in cls.components


def _fig(value: float) -> str:
    return f"{value:.3f}" if value >= 0 else "-"


def accuracy_table(summary: Any) -> Table:
    """Train split and held-out side by side, before and after RL, sampled and greedy.

    Both splits are scored the same way (fresh tasks of the split, the same sampling), so a
    policy that memorises its training prompts shows as train rising while held-out does not.
    """
    plan = summary.plan
    t = Table(title="accuracy — train split vs held-out", show_edge=True)
    t.add_column("decoding")
    # Each column names the version it scored: "after" is the final version, the one the closing
    # "held-out accuracy of vN" line above the table shows.
    before, after = "(v0)", f"(v{summary.final_version})"
    for col in (
        f"train before {before}",
        f"train after {after}",
        f"held-out before {before}",
        f"held-out after {after}",
    ):
        t.add_column(col, justify="right")
    t.add_row(
        "sampled",
        _fig(summary.train_accuracy_before),
        _fig(summary.train_accuracy_after),
        f"{summary.heldout_accuracy_before:.3f}",
        f"{summary.heldout_accuracy_after:.3f}",
    )
    t.add_row(
        "greedy",
        _fig(summary.train_greedy_before),
        _fig(summary.train_greedy_after),
        f"{summary.heldout_greedy_before:.3f}",
        f"{summary.heldout_greedy_after:.3f}",
    )
    rates = (summary.heldout_invalid_call_rate_before, summary.heldout_invalid_call_rate_after)
    if any(rates) or _calls_tools(plan.env):
        # Beside the success it goes with: a rate that falls because the policy stopped calling shows.
        t.add_row(
            "invalid tool calls per call (sampled)",
            _fig(summary.train_invalid_call_rate_before),
            _fig(summary.train_invalid_call_rate_after),
            f"{rates[0]:.3f}",
            f"{rates[1]:.3f}",
        )
    train = f"{plan.train_eval_tasks} train-split" if plan.train_eval_tasks else "no train-split"
    t.caption = (
        f"{train} and {summary.heldout_tasks} held-out tasks; "
        f"sampled: {plan.heldout_samples} per task at T={plan.temperature:g}"
    )
    return t


# What each drop reason means, for the summary's one line (slipstream.rl.DropReason has the full text).
DROP_WHY = {
    "uniform_group": "every reward in its group equal, so GRPO's advantages are 0: nothing to learn",
    "stale": "sampled more than max_staleness versions behind",
    "incomplete_group": "its group never filled in time",
    "duplicate": "already trained (a redelivery)",
    "malformed": "failed validation",
    "no_trained_tokens": "nothing trainable",
    "infra_error": "an infrastructure failure",
    "unscorable": "its reward could not be computed",
    "heldout": "a held-out episode",
    "untrusted": "its score was not signed by a trusted reward-model key",
}


def trained_line(tr: dict[str, Any]) -> str:
    """The share of scored trajectories trained, and in one line why the others were dropped."""
    scored = tr.get("scored") or 0
    if not scored:
        return "-"
    share = f"{tr.get('trained', 0) / scored:.3f}"
    why = [f"{k}: {DROP_WHY.get(k, k)}" for k, v in sorted((tr.get("dropped") or {}).items()) if v]
    return f"{share} (dropped as {'; '.join(why)})" if why else share


def dead_lettered(tr: dict[str, Any]) -> str:
    if "dead_lettered" not in tr:
        return "-"
    return str(tr["dead_lettered"] + tr.get("dead_lettered_scored", 0))


def restarts_line(restarts: dict[str, int]) -> str:
    done = {k: v for k, v in sorted(restarts.items()) if v}
    return ", ".join(f"{k} {v}" for k, v in done.items()) if done else "none"


def screen_line(screen: dict[str, Any]) -> str:
    """The workers' task screen: tasks skipped as predicted uniform, of those it judged (no rollouts spent)."""
    judged = int(screen.get("kept", 0)) + int(screen.get("screened", 0))
    share = f" ({screen.get('screened', 0) / judged:.0%})" if judged else ""
    return f"{screen.get('screened', 0)} of {judged}{share}, target {screen.get('target')}"


def applies_summary(applies: dict[str, list[dict[str, Any]]]) -> str:
    """Per worker: versions applied, median / max apply ms, and median / max wait ms where the engine waits
    (vLLM); every row is in the summary JSON's `weight_applies`."""
    out = []
    for worker, rows in sorted(applies.items()):
        line = f"{worker}: {len(rows)} versions"
        for key, what in (("apply_ms", "apply"), ("wait_ms", "wait")):
            values = sorted(float(r[key]) for r in rows if r.get(key) is not None)
            if values:
                line += f", {what} median {values[len(values) // 2]:.0f} / max {values[-1]:.0f} ms"
        out.append(line)
    return "; ".join(out)


def summary_table(summary: Any) -> Group:
    """The closing summary: the accuracy table, then what the run did."""
    t = Table(title="slipstream demo — summary", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    tr = summary.trajectories or {}
    left = tr.get("left_unscored", 0) + tr.get("left_in_learner_stream", 0)
    calls = (summary.heldout_tool_calls_before, summary.heldout_tool_calls_after)
    rows = [
        ("result", "ok" if summary.ok else "FAILED"),
        *(
            [("held-out tool calls per episode before / after", f"{calls[0]:.2f} / {calls[1]:.2f}")]
            if any(calls) or _calls_tools(summary.plan.env)
            else []
        ),
        ("learner steps", str(summary.steps)),
        ("versions published", f"{summary.versions_published} (final v{summary.final_version})"),
        ("trajectories published", str(tr.get("published", "-"))),
        ("  scored / trained", f"{tr.get('scored', '-')} / {tr.get('trained', '-')}"),
        ("  dropped", ", ".join(f"{k} {v}" for k, v in sorted((tr.get("dropped") or {}).items())) or "none"),
        ("  trained share", trained_line(tr)),
        *([("  tasks screened out before sampling", screen_line(tr["screen"]))] if tr.get("screen") else []),
        ("  dead-lettered / left unconsumed", f"{dead_lettered(tr)} / {left}"),
        *(
            [("  injected from outside (scored stream)", str(tr["injected_scored"]))]
            if tr.get("injected_scored")
            else []
        ),
        ("  all accounted for", str(bool(tr.get("accounted_raw")) and bool(tr.get("accounted_scored")))),
        ("service restarts", restarts_line(summary.restarts)),
        ("rollouts spanning a weight update", str(summary.spanning_versions)),
        *(
            [("weight versions applied (per worker)", applies_summary(summary.weight_applies))]
            if getattr(summary, "weight_applies", None)
            else []
        ),
        ("weights stored vs full snapshots", weights_line(summary.weights)),
        ("training time", f"{summary.train_time_s:.0f} s"),
        ("wall time", f"{summary.wall_time_s:.0f} s"),
    ]
    for k, v in rows:
        t.add_row(k, v)
    metrics = metrics_table(summary)
    return Group(accuracy_table(summary), *([metrics] if metrics is not None else []), t)


# The env figures the summary shows, in this order, when the env reports them (search: Context-1's table).
METRIC_ROWS = (
    ("final_answer_found", "final-answer-found"),
    ("output_recall", "output recall"),
    ("traj_recall", "trajectory recall"),
    ("precision", "precision"),
    ("f1", "F1"),
    ("prune_accuracy", "prune accuracy"),
    ("prune_share", "episodes that prune"),
    ("tool_calls_per_turn", "tool calls per turn"),
    ("turns_per_episode", "turns per episode"),
    ("turns_median", "turns per episode (median)"),
    ("budget_refusals_per_episode", "budget refusals per episode"),
    ("budget_refusals", "budget refusals (all episodes)"),
    ("malformed_output", "malformed output"),
)


def metrics_table(summary: Any) -> Table | None:
    """The env's own figures (`Environment.eval_metrics`, sampled), train beside held-out, before and after RL."""
    columns = (
        summary.train_metrics_before,
        summary.train_metrics_after,
        summary.heldout_metrics_before,
        summary.heldout_metrics_after,
    )
    if not any(columns):
        return None
    t = Table(title=f"{summary.plan.env} metrics — train split vs held-out (sampled)", show_edge=True)
    t.add_column("metric")
    for col in ("train before", "train after", "held-out before", "held-out after"):
        t.add_column(col, justify="right")
    known = [k for k, _ in METRIC_ROWS]
    extra = sorted({k for c in columns for k in c} - set(known) - {"episodes"})
    for key, label in [*METRIC_ROWS, *((k, k) for k in extra)]:
        if any(key in c for c in columns):
            shown = "{:.0f}" if key == "budget_refusals" else "{:.3f}"  # a count
            t.add_row(label, *(shown.format(c[key]) if key in c else "-" for c in columns))
    return t
