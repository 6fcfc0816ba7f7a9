"""`slipstream report`: the HTML page, the PNGs, and report.json holding one plotted point per step.

The run directories are synthetic (a RunSummary with N steps, JSON log lines, a span file), so
every plotted number is known in advance. Only the first test draws the PNGs (matplotlib takes
a second or two for five figures); the others check the series through `--json-only`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from slipstream.cli.__main__ import main
from slipstream.run.report import (
    BATCH_ACCURACY,
    BATCH_REWARD,
    HELDOUT_GREEDY,
    HELDOUT_SAMPLED,
    STAGE_SUM,
    ReportError,
    build_report,
    load_run,
    resolve_run,
    write_html,
)
from slipstream.run.training import RunSummary, TrainingPlan
from slipstream.stack.stackfile import ServiceEntry, StackFile, StoreEntry, encode_stack_file

pytestmark = pytest.mark.unit

N = 12
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
T0 = 1_800_000_000.0


def stamp(t: float) -> str:
    from datetime import UTC, datetime

    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def steps_log() -> list[dict[str, Any]]:
    return [
        {
            "step": i,
            "version": i,
            "loss": 0.1,
            "reward": 0.2 + 0.05 * i,
            "accuracy": 0.1 + 0.04 * i,
            "trajectories": 64,
            "staleness": {"0": 40, "1": 20, "2": 4} if i % 2 else {"0": 64},
            "dropped": {},
            "step_time_s": 0.5,
            "t": 2.0 * i,
            "mismatch_kl": 0.001 * i,
            "masked_share": 0.25 if i % 2 else 0.0,
            "kl": None if i == 1 else 0.01 * i,  # a step that ran no reference reports None
        }
        for i in range(1, N + 1)
    ]


def write_run(tmp: Path, *, summary: bool = True, traces: bool = True, logs: bool = True) -> Path:
    run = tmp / "run-a"
    (run / "logs").mkdir(parents=True)
    if summary:
        s = RunSummary(
            ok=True,
            plan=TrainingPlan(max_steps=N),
            heldout_tasks=64,
            heldout_accuracy_before=0.25,
            heldout_accuracy_after=0.75,
            steps=N,
            final_version=N,
            versions_published=N,
            # versions 0 and N repeat the before/after figures, as `run_training` records them
            eval_curve=[
                {"version": 0.0, "accuracy": 0.25},
                {"version": 5.0, "accuracy": 0.5, "reward": 0.5},
                {"version": 10.0, "accuracy": 0.625},
                {"version": float(N), "accuracy": 0.75},
            ],
            steps_log=steps_log(),
        )
        (run / "summary.json").write_bytes(msgspec.json.encode(s))
    if logs:
        learner = [
            {"event": "step", "step": i, "policy_version": i, "reward_mean": 0.3, "accuracy": 0.2,
             "n_trajectories": 64, "time_s": 0.5, "staleness": {"0": 64}, "timestamp": stamp(T0 + 2 * i),
             "mismatch_kl": 0.002, "masked_share": 0.5}
            for i in range(1, N + 1)
        ]  # fmt: skip
        publisher = [
            {"event": "announced", "policy_version": i, "timestamp": stamp(T0 + 2 * i + 0.25)} for i in range(1, N + 1)
        ]
        worker = [
            {"event": "applied weights", "policy_version": i, "timestamp": stamp(T0 + 2 * i + 1.0)}
            for i in range(1, N + 1)
        ]
        for name, rows in (("learner", learner), ("weight-publisher", publisher), ("rollout-worker", worker)):
            text = "not json: a stray print\n" + "".join(json.dumps(r) + "\n" for r in rows)
            (run / "logs" / f"{name}.log").write_text(text)
        (run / "logs" / "nats.log").write_text("[1] [INF] Starting nats-server\n[1] [INF] Server is ready\n")
    if traces:
        spans = []
        for k in range(10):
            start = int((T0 + k) * 1e9)
            spans += [
                span("a" * 15 + str(k), None, "publish tasks.arith", "producer", "task-source", start, 10_000_000),
                span("b" * 15 + str(k), "a" * 15 + str(k), "process tasks.arith", "consumer", "rollout-worker",
                     start + 20_000_000, 500_000_000),
                # nested inside the worker's span: must not count towards the worker's stage time twice
                span("c" * 15 + str(k), "b" * 15 + str(k), "publish traj.raw.arith", "producer", "rollout-worker",
                     start + 400_000_000, 50_000_000),
            ]  # fmt: skip
        (run / "traces.all.jsonl").write_text("".join(json.dumps(s) + "\n" for s in spans))
        services = {n: ServiceEntry(traces_file=str(run / "traces.all.jsonl")) for n in ("task-source",)}
        stack = StackFile(run_id=run.name, servers={}, store=StoreEntry(), services=services)
        (run / "stack.json").write_bytes(encode_stack_file(stack))
    return run


def span(sid: str, parent: str | None, name: str, kind: str, service: str, start: int, dur: int) -> dict[str, Any]:
    return {
        "trace_id": "f" * 32, "span_id": sid, "parent_span_id": parent, "name": name, "kind": kind,
        "service": service, "start_ns": start, "end_ns": start + dur, "status": "unset",
        "attributes": {}, "links": [], "events": [],
    }  # fmt: skip


def series(report: dict[str, Any], plot: str, panel: int = 0) -> dict[str, Any]:
    return dict(report["plots"][plot]["panels"][panel]["series"])


def test_every_plot_is_written_with_one_point_per_step(tmp_path: Path) -> None:
    run = write_run(tmp_path)
    out = tmp_path / "out"
    report = build_report(run, out)
    assert set(report["plots"]) == {"reward", "staleness", "mismatch", "throughput", "time_to_policy", "stages"}
    assert report["skipped"] == {}
    for name in report["plots"]:
        assert (out / f"{name}.png").read_bytes()[:8] == PNG_MAGIC, name
    assert json.loads((out / "report.json").read_text()) == json.loads(json.dumps(report))

    steps = [float(i) for i in range(1, N + 1)]
    rw = series(report, "reward")
    assert rw[BATCH_REWARD]["x"] == steps
    assert rw[BATCH_REWARD]["y"] == pytest.approx([0.2 + 0.05 * i for i in range(1, N + 1)])
    assert rw[BATCH_ACCURACY]["x"] == steps and len(rw[BATCH_ACCURACY]["y"]) == N
    # before RL at step 0, versions 5 and 10 (= steps 5 and 10), after RL at the last step
    assert rw[HELDOUT_SAMPLED] == {"x": [0.0, 5.0, 10.0, float(N)], "y": [0.25, 0.5, 0.625, 0.75]}
    assert HELDOUT_GREEDY not in rw  # the curve carries no greedy figures: none are drawn (not zeros)

    dist, per_step = series(report, "staleness", 0), series(report, "staleness", 1)
    half = N // 2  # odd steps: 40/20/4 at lags 0/1/2; even steps: 64 at lag 0
    assert dist["trajectories"] == {"x": [0.0, 1.0, 2.0], "y": [40.0 * half + 64 * half, 20.0 * half, 4.0 * half]}
    assert per_step["mean staleness"]["x"] == steps
    assert per_step["mean staleness"]["y"][:2] == pytest.approx([28 / 64, 0.0])

    mismatch = report["plots"]["mismatch"]
    assert mismatch["title"] == "Train–inference mismatch and off-policy masking per step"
    assert [p["title"] for p in mismatch["panels"]] == [
        "train–inference mismatch: KL(behaviour ‖ learner) per trained token",
        "share of trained tokens the off-policy mask removed",
        "KL(policy ‖ frozen reference) per trained token",
    ]
    assert series(report, "mismatch", 0)["mismatch"] == {
        "x": steps,
        "y": pytest.approx([0.001 * i for i in range(1, N + 1)]),
    }
    assert series(report, "mismatch", 1)["masked share"]["y"] == [0.25, 0.0] * (N // 2)
    assert series(report, "mismatch", 2)["KL to the reference"]["x"] == steps[1:]  # step 1 had none

    ttp = series(report, "time_to_policy")
    assert ttp["step -> first worker applied"]["x"] == steps
    assert ttp["step -> first worker applied"]["y"] == pytest.approx([1.0] * N)
    assert ttp["step -> announced"]["y"] == pytest.approx([0.25] * N)

    stages = report["plots"]["stages"]["panels"][0]
    assert stages["labels"] == ["rollout-worker: process tasks.arith (x10)", "task-source: publish tasks.arith (x10)"]
    assert stages["series"][STAGE_SUM]["y"] == pytest.approx([5.0, 0.1])

    tp = series(report, "throughput", 0)
    assert set(tp) == {"rollout-worker", "task-source"}
    assert all(len(s["x"]) == len(s["y"]) == 10 for s in tp.values())  # 9.5 s of spans: ten slices of >= 1 s
    width = tp["task-source"]["x"][1]
    assert sum(tp["task-source"]["y"]) * width == pytest.approx(10)  # ten publishes in all
    learner = series(report, "throughput", 1)["learner"]
    assert learner["y"] == pytest.approx([32.0] * N)  # 64 trajectories every 2 s

    page = (out / "index.html").read_text()
    for name in report["plots"]:
        assert f'src="{name}.png"' in page
    assert "0.250 / 0.750" in page and "Not plotted" not in page


def test_without_traces_the_trace_plots_are_skipped_with_a_note(tmp_path: Path) -> None:
    run = write_run(tmp_path, traces=False)
    report = build_report(run, tmp_path / "out", pictures=False)
    assert set(report["skipped"]) == {"stages"} and "--traces" in report["skipped"]["stages"]
    old = write_run(tmp_path / "old", traces=False)  # a run from before the learner reported the mismatch
    summary = json.loads((old / "summary.json").read_text())
    for row in summary["steps_log"]:
        del row["mismatch_kl"], row["masked_share"], row["kl"]
    (old / "summary.json").write_text(json.dumps(summary))
    skipped = build_report(old, tmp_path / "old-out", pictures=False)["skipped"]
    assert "no mismatch_kl or masked_share" in skipped["mismatch"]
    assert [p["title"] for p in report["plots"]["throughput"]["panels"]] == ["learner: trajectories trained per second"]
    assert not list((tmp_path / "out").glob("*.png")) and not (tmp_path / "out" / "index.html").exists()
    write_html(load_run(run, []), [], report["skipped"], tmp_path / "page.html")
    page = (tmp_path / "page.html").read_text()
    assert "Not plotted" in page and "start the stack with --traces FILE" in page


def test_without_a_summary_the_steps_come_from_the_learner_log(tmp_path: Path) -> None:
    run = write_run(tmp_path, summary=False, traces=False)
    assert main(["report", str(run), "--out", str(tmp_path / "out"), "--json-only"]) == 0
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert (report["steps"], report["steps_source"]) == (N, "logs/learner.log")
    rw = series(report, "reward")
    assert rw[BATCH_REWARD]["x"] == [float(i) for i in range(1, N + 1)]
    assert HELDOUT_SAMPLED not in rw
    assert series(report, "mismatch", 0)["mismatch"]["y"] == [0.002] * N  # from the learner's step lines
    assert series(report, "mismatch", 1)["masked share"]["y"] == [0.5] * N
    assert len(report["plots"]["mismatch"]["panels"]) == 2  # no KL in those lines: no KL panel
    # one stray print per service log; nats.log (no JSON at all) is a server's log, not counted
    assert report["notes"] == ["3 log lines were not JSON objects and were skipped"]


def test_a_run_without_steps_or_directory_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = write_run(tmp_path, summary=False, logs=False, traces=False)
    with pytest.raises(ReportError, match="no learner steps"):
        build_report(run, tmp_path / "out")
    with pytest.raises(ReportError, match="no run directory"):
        resolve_run(str(tmp_path / "nope"))
    assert main(["report", str(tmp_path / "nope")]) == 1
    assert "no run directory" in capsys.readouterr().out


def test_the_episode_shape_of_the_learner_log_reaches_the_summary() -> None:
    from slipstream.run.report import EPISODE_FIGURES, Run, _summary_rows, steps_from_logs

    rows = [
        {
            "event": "step",
            "step": i,
            "timestamp": stamp(T0 + i),
            "n_trajectories": 4,
            **dict.fromkeys(EPISODE_FIGURES, v),
        }
        for i, v in ((1, 0.5), (2, 0.25))
    ]
    steps = steps_from_logs(rows)
    assert [s["invalid_call_rate"] for s in steps] == [0.5, 0.25]
    run = Run(
        run_dir=Path("r"), summary={}, steps=steps, steps_source="logs", logs={}, spans=[], span_files=[], notes=[]
    )
    (line,) = [v for k, v in _summary_rows(run) if k.startswith("episodes")]
    assert "invalid call rate 0.500 / 0.250" in line and "turns per episode 0.500 / 0.250" in line


def test_the_reward_weights_and_episode_means_of_the_learner_log_reach_the_steps() -> None:
    from slipstream.run.report import steps_from_logs

    rows = [
        {
            "event": "step",
            "step": i,
            "timestamp": stamp(T0 + i),
            "reward_weights": {"parallel": lam},
            "episode_means": {"critical_steps": 3.0 + i, "component.perf": 0.5},
        }
        for i, lam in ((1, 0.1), (2, 0.05))
    ]
    rows.append({"event": "step", "step": 3, "timestamp": stamp(T0 + 3)})  # a run without a schedule
    steps = steps_from_logs(rows)
    assert [s.get("reward_weights") for s in steps] == [{"parallel": 0.1}, {"parallel": 0.05}, None]
    assert steps[1]["episode_means"] == {"critical_steps": 5.0, "component.perf": 0.5}
