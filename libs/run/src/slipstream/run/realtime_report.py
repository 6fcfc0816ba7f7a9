"""The realtime demo's report: per promote cycle rows, the run's summary, the table and the plot.

Pure functions over what `slipstream.run.realtime` observed (the simulator's turns, the versions
serving ran and when, the learner's outcomes file), so they are unit-tested without a stack.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import msgspec

from slipstream.run.report_figure import save
from slipstream.run.sim import PREFERENCES, SimStats


class Observed(msgspec.Struct, kw_only=True):
    """What the bus said during the run (and the side judge's report, when one ran)."""

    steps: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    promotions: list[dict[str, Any]] = []
    judge: dict[str, Any] = {}


def session_of(episode_id: str) -> str:
    """The session of a served episode id (`serve/<session>/<n>`); '' for any other id."""
    parts = episode_id.split("/")
    return parts[1] if len(parts) >= 3 and parts[0] == "serve" else ""


def read_outcomes(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [msgspec.json.decode(line) for line in path.read_bytes().splitlines() if line.strip()]


def cycle_rows(
    stats: SimStats, seen: Observed, serving_at: dict[int, float], outcomes: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One row per promoted version, in promotion order (version 0's cycle first)."""
    promoted: list[int] = []
    at: dict[int, float] = {}
    for p in seen.promotions:
        v = int(p["policy_version"])
        if v not in promoted and (not promoted or v > promoted[-1]):
            promoted.append(v)
            at[v] = float(p.get("promoted_at") or 0.0)
    if not promoted or promoted[0] != 0:
        promoted.insert(0, 0)
    sessions: dict[str, list[Any]] = {}
    for t in stats.turns:
        sessions.setdefault(t.session_id, []).append(t)
    trained = [o for o in outcomes if o.get("outcome") == "trained"]
    evals = {int(e["policy_version"]): e for e in seen.evals}
    rows: list[dict[str, Any]] = []
    for k, v in enumerate(promoted):
        acc, n = stats.acceptance(v)
        acc1, n1 = stats.acceptance(v, first_turn_only=True)
        row: dict[str, Any] = {
            "cycle": k,
            "version": v,
            "acceptance": round(acc, 4),
            "answers": n,
            "acceptance_first_turn": round(acc1, 4),
            "first_turns": n1,
            "promoted_at": at.get(v),
            "serving_at": serving_at.get(v),
        }
        judged = (seen.judge.get("by_version") or {}).get(str(v))
        if judged is not None:
            row["agreement"] = judged.get("agreement")
            row["judge"] = judged
        e = evals.get(v)
        if e is not None:
            row["gate"] = {
                "decision": e.get("decision"),
                "passed": e.get("decision") == "promote",
                "score": e.get("score"),
                "baseline_version": e.get("baseline_version"),
                "baseline_score": e.get("baseline_score"),
                "reason": e.get("reason"),
            }
        if k > 0:
            prev = promoted[k - 1]
            row["rejected_before"] = [
                {"version": ev, "reason": evals[ev].get("reason")}
                for ev in sorted(evals)
                if prev < ev < v and evals[ev].get("decision") != "promote"
            ]
            row.update(_loop_time(v, trained, sessions, stats, serving_at))
            row["staleness"] = _token_staleness(
                [o for o in trained if prev < int(o.get("policy_version", 0)) <= v], sessions
            )
        rows.append(row)
    return rows


def _loop_time(
    v: int, trained: list[dict[str, Any]], sessions: dict[str, list[Any]], stats: SimStats, serving_at: dict[int, float]
) -> dict[str, Any]:
    batch = [session_of(o["trajectory_id"]) for o in trained if int(o.get("policy_version", -1)) == v]
    starts = [stats.session_started[s] for s in batch if s in stats.session_started]
    out: dict[str, Any] = {"batch_episodes": len(batch)}
    if starts and v in serving_at:
        out["loop_time_s"] = round(serving_at[v] - min(starts), 2)
        out["loop_time_from_last_s"] = round(serving_at[v] - max(starts), 2)
    return out


def _token_staleness(trained: list[dict[str, Any]], sessions: dict[str, list[Any]]) -> dict[str, Any]:
    """Learner version - token version over every sampled token of the trajectories trained in a cycle.

    A step producing version V computes its gradient on version V-1's weights, so a token sampled
    by V-1 has staleness 0."""
    hist: dict[int, int] = {}
    for o in trained:
        learner_version = int(o.get("policy_version", 0)) - 1
        for t in sessions.get(session_of(o["trajectory_id"]), []):
            for version, n in t.segments:
                lag = learner_version - int(version)
                hist[lag] = hist.get(lag, 0) + int(n)
    tokens = sum(hist.values())
    if not tokens:
        return {"tokens": 0}
    mean = sum(k * n for k, n in hist.items()) / tokens
    return {
        "tokens": tokens,
        "mean": round(mean, 3),
        "max": max(hist),
        "histogram": {str(k): hist[k] for k in sorted(hist)},
    }


def summarize(preference: str, stats: SimStats, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The headline: acceptance first vs last cycle, and whether every promotion passed the gate
    (`preference`: the users' hidden preference, `RealtimePlan.preference`)."""
    trained_rows = [r for r in rows if r["cycle"] > 0]
    out: dict[str, Any] = {
        "preference": preference,
        "preference_text": PREFERENCES[preference][0],
        "cycles_completed": len(trained_rows),
        "sessions": stats.sessions,
        "answers": len(stats.turns),
        "failed_calls": stats.failed_calls,
        "http_429": stats.http_429,
        "http_5xx": stats.http_5xx,
        "feedback": dict(stats.feedback_status),
    }
    if rows:
        out["acceptance_first"] = rows[0]["acceptance"]
        out["acceptance_last"] = rows[-1]["acceptance"]
        out["acceptance_rise"] = round(rows[-1]["acceptance"] - rows[0]["acceptance"], 4)
        accs = [r["acceptance"] for r in rows]
        out["acceptance_by_cycle"] = accs
        out["rises_every_cycle"] = all(b > a for a, b in itertools.pairwise(accs))
    out["gate_passed_every_promotion"] = bool(trained_rows) and all(
        (r.get("gate") or {}).get("passed", False) for r in trained_rows
    )
    loops = [r["loop_time_s"] for r in trained_rows if "loop_time_s" in r]
    if loops:
        out["loop_time_s_median"] = round(statistics.median(loops), 2)
    means = [r["staleness"]["mean"] for r in trained_rows if r.get("staleness", {}).get("tokens")]
    if means:
        out["token_staleness_mean"] = round(statistics.fmean(means), 3)
    return out


def plot_acceptance(summaries: list[dict[str, Any]], path: Path) -> Path:
    """Acceptance per promote cycle, one line per run (seed)."""
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        rows = s.get("cycles") or []
        ax.plot(
            [r["cycle"] for r in rows],
            [r["acceptance"] for r in rows],
            marker="o",
            label=f"seed {s.get('plan', {}).get('seed', '?')}",
        )
    ax.set_xlabel("promote cycle (0: the warm-started version)")
    ax.set_ylabel("simulator acceptance rate")
    ax.set_ylim(0, 1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("slipstream demo --realtime")
    fig.tight_layout()
    return save(fig, path, dpi=100)


def summary_table(summary: dict[str, Any]) -> Any:
    """The per-cycle table the demo prints."""
    from rich.table import Table

    t = Table(title="promote cycles", title_justify="left")
    for col in ("cycle", "version", "acceptance", "answers", "loop time s", "token staleness", "gate", "agreement"):
        t.add_column(col)
    for r in summary.get("cycles") or []:
        gate = r.get("gate") or {}
        st = r.get("staleness") or {}
        t.add_row(
            str(r["cycle"]),
            f"v{r['version']}",
            f"{r['acceptance']:.3f}",
            str(r["answers"]),
            f"{r['loop_time_s']:.1f}" if "loop_time_s" in r else "-",
            f"mean {st['mean']:.2f}, max {st['max']}" if st.get("tokens") else "-",
            (("pass" if gate.get("passed") else "fail") + f" {gate.get('score', 0):.3f}") if gate else "-",
            f"{r['agreement']:.3f}" if isinstance(r.get("agreement"), float) else "-",
        )
    return t
