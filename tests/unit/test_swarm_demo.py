"""`slipstream demo --env swarm`: the plan, what reaches the services, the parallelism curve and its plot.

The run itself is the demo's (its shrunk run does not train yet: tests/e2e/test_run_files.py says
why); here: the plan's budget arithmetic, its config reaching the learner (the λ schedule) and the
workers (sub-agents frozen at the first version), the curve read from the learner's step rows,
and the PNG and table.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rich.console import Console

from slipstream.envs import get_env
from slipstream.learner.config import LearnerConfig
from slipstream.rollout_worker.config import RolloutWorkerConfig
from slipstream.run import service_env, swarm_demo, swarm_eval
from slipstream.run.presets import demo_plan
from slipstream.run.training import RunSummary
from slipstream.runtime.config import resolve

pytestmark = pytest.mark.unit


def test_the_plan_puts_every_serial_episode_of_4_or_more_items_over_the_budget_and_a_parallel_one_in_it() -> None:
    plan = demo_plan("swarm")
    env = get_env("swarm", **plan.env_options)
    o = env.options
    # a sub-agent: one grep and the answer (the search demo's corpus); serial: N calls + the answer
    assert o.search["expert_grep"] and o.search["fixed_offsets"] and o.search["max_hops"] == 1
    assert 1 + 2 + 1 == o.max_critical_steps < 4 + 1 and sorted(o.counts) == [2, 4, 8]
    assert plan.max_tokens >= o.turn_tokens // 2 and plan.preset == "micro"
    for name in ("parallel", "finish"):
        schedule = plan.reward_schedule[name]
        assert schedule["init"] == 0.1 and schedule["final"] == 0.0
        assert schedule["anneal_steps"] == plan.max_steps  # positive until the last update: see examples/swarm.toml


def test_the_plan_reaches_the_services() -> None:
    plan = demo_plan("swarm")
    environ = service_env(plan, Path("/m"), Path("/s"), Path("/o"))
    learner = resolve(LearnerConfig, environ=environ)
    assert set(learner.learner.reward_schedule) == {"parallel", "finish"}
    worker = resolve(RolloutWorkerConfig, environ=environ)
    assert json.loads(environ["SLIPSTREAM_WORKER__ENV_OPTIONS"])["swarm"]["max_critical_steps"] == 4
    # the sub-agents: frozen at the first version the worker loads (the warm-start)
    assert (worker.subagents.transport, worker.subagents.pin_version) == ("local", -1)


def _summary(tmp_path: Path) -> RunSummary:
    plan = demo_plan("swarm")
    rows = [
        {
            "step": s,
            "version": s,
            "episode_means": {
                "subagents": 1.0 + s,
                "parallel_turns": 0.1 * s,
                "critical_steps": 4.5 - 0.1 * s,
                "component.perf": 0.5,
            },
            "reward_weights": {"parallel": 0.1 * (1 - s / 5)},
        }
        for s in range(1, 6)
    ]
    return RunSummary(ok=True, plan=plan, run_dir=str(tmp_path), steps=5, steps_log=[{"step": 0}, *rows])


def test_the_parallelism_curve_comes_from_the_learner_steps(tmp_path: Path) -> None:
    curve = swarm_demo.parallelism_curve(_summary(tmp_path))
    assert [c["step"] for c in curve] == [1, 2, 3, 4, 5]  # a row without means is not a point
    assert [c["subagents"] for c in curve] == [2.0, 3.0, 4.0, 5.0, 6.0]
    assert [c["parallel_turns"] for c in curve] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5])
    # the learner averages the swarm's parallel counts per step unless a plan says otherwise
    assert {"parallel_turns", "parallel_agents", "subagents"} <= set(LearnerConfig().learner.step_means)
    assert curve[-1]["lambda_parallel"] == pytest.approx(0.0)


def test_the_plot_and_the_table_show_swarm_beside_single(tmp_path: Path) -> None:
    row = {"accuracy": 0.5, "perf": 0.8, "critical_steps": 4.0, "subagents": 4.2}
    report = {"seed": 0, "steps": 5, "budget": 4, "curve": swarm_demo.parallelism_curve(_summary(tmp_path))}
    report["after/swarm/heldout"] = row
    report["after/single/heldout"] = {**row, "accuracy": 0.0, "subagents": 0.0}
    report["ceiling/swarm/heldout"] = {**row, "accuracy": 0.875}
    png = swarm_demo.plot(report, tmp_path / "swarm.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    console = Console(record=True, width=200)
    console.print(swarm_demo.table(report))
    text = console.export_text()
    swarm = next(x for x in text.splitlines() if "after" in x and "heldout" in x and "swarm" in x)
    single = next(x for x in text.splitlines() if "after" in x and "heldout" in x and "single" in x)
    assert "0.500" in swarm and "4.200" in swarm and "0.000" in single
    # the swarm's ceiling (the teacher in parallel over its sub-agents) has a row; the single arm has none
    assert [x for x in text.splitlines() if x.lstrip("│ ").startswith("ceiling")] == [
        next(x for x in text.splitlines() if "ceiling" in x and "0.875" in x)
    ]
    assert next(x for x in text.splitlines() if "before" in x).count("-") >= len(swarm_eval.FIGURES)


def _demo_args(tmp_path: Path, **kw: object) -> object:
    import argparse

    base = {"swarm_arm": "both", "swarm_lambda": None, "swarm_items": None, "swarm_budget_model": None}
    return argparse.Namespace(run_dir=tmp_path / "run", **{**base, **kw})


def test_init_model_starts_one_arm_only_and_must_be_a_saved_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = demo_plan("swarm")
    # Each arm has its own warm-start: one given model for both arms is refused before anything starts.
    assert swarm_demo.run(plan, _demo_args(tmp_path, init_model=tmp_path)) == 2
    assert "--swarm-arm swarm or single" in capsys.readouterr().out
    assert swarm_demo.run(plan, _demo_args(tmp_path, init_model=tmp_path / "nowhere", swarm_arm="swarm")) == 2
    assert "is not a saved model" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()


def test_rl_budgets_change_the_rl_plan_only_and_a_bad_value_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = swarm_demo.arm_plan(demo_plan("swarm"), "swarm")
    rl = swarm_demo.rl_plan(plan, [4])
    # RL's train tasks all at the evaluations' budget; the warm-start's teacher keeps its longer ones
    assert rl.env_options["train_budgets"] == [4] and plan.env_options["train_budgets"] == [4, 4, 7, 10, 13, 22]
    assert {k: v for k, v in rl.env_options.items() if k != "train_budgets"} == {
        k: v for k, v in plan.env_options.items() if k != "train_budgets"
    }
    assert swarm_demo.rl_plan(plan, None) is plan
    environ = service_env(rl, Path("/m"), Path("/s"), Path("/o"))
    assert json.loads(environ["SLIPSTREAM_WORKER__ENV_OPTIONS"])["swarm"]["train_budgets"] == [4]
    env = get_env("swarm", **rl.env_options)
    assert {t.metadata["budget"] for t in env.generate("train", 24, 3)} == {"4"}
    for bad in ("0", "4,x", "2000"):
        with pytest.raises(SystemExit, match="--swarm-rl-budgets takes critical-step budgets"):
            swarm_demo.run(demo_plan("swarm"), _demo_args(tmp_path, swarm_arm="swarm", swarm_rl_budgets=bad))
    assert not (tmp_path / "run").exists()


def test_a_stopped_runs_learner_steps_come_from_its_log_and_a_wrong_dir_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    arm_dir = tmp_path / "run" / "single"
    (arm_dir / "logs").mkdir(parents=True)
    means = {"subagents": 1.0, "parallel_turns": 0.5, "critical_steps": 4.0, "component.perf": 0.25}
    rows = [
        {"event": "step", "step": 1, "episode_means": means},
        {"event": "no learner step: every group's rewards were equal", "step": 1},
        {"event": "step", "step": 2, "episode_means": {**means, "parallel_turns": 1.0}},
        # a learner killed and resumed logs its last step again
        {"event": "step", "step": 2, "episode_means": {**means, "parallel_turns": 2.0}},
    ]
    text = "\n".join(json.dumps(r) for r in rows) + '\nnot json\n{"event": "step", "st'
    (arm_dir / "logs" / "learner.log").write_text(text)
    steps = swarm_demo.learner_steps(arm_dir)
    assert [r["step"] for r in steps] == [1, 2] and steps[1]["episode_means"]["parallel_turns"] == 2.0
    curve = swarm_demo.parallelism_curve(type("S", (), {"steps_log": steps})())
    assert [c["parallel_turns"] for c in curve] == [0.5, 2.0]

    plan = demo_plan("swarm")
    model = tmp_path / "model"
    # no arm or no warm-start: refused, naming what is missing
    args = _demo_args(tmp_path, swarm_evaluate_run=tmp_path / "run", init_model=None, swarm_arm="single")
    assert swarm_demo.run(plan, args) == 2
    assert "--init-model" in capsys.readouterr().out
    args = _demo_args(tmp_path, swarm_evaluate_run=tmp_path / "run", init_model=model, swarm_arm="both")
    assert swarm_demo.run(plan, args) == 2
    # the arm's directory has steps but no stored versions; the swarm arm's has neither
    for arm in ("single", "swarm"):
        args = _demo_args(tmp_path, swarm_evaluate_run=tmp_path / "run", init_model=model, swarm_arm=arm)
        assert swarm_demo.run(plan, args) == 2
        assert f"{tmp_path / 'run' / arm} holds no stored versions" in capsys.readouterr().out
    assert not (tmp_path / "run" / "swarm.json").exists()


@pytest.mark.parametrize("steps", [0, 7])
def test_a_run_whose_rl_stopped_part_way_is_evaluated_at_its_last_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int
) -> None:
    import json

    import slipstream.run.training as training
    import slipstream.run.warmstart as warmstart
    from slipstream.run.plan import RunSummary

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    error = f"training did not finish within the run's timeout_s = 60 s (step {steps} of 60)"
    monkeypatch.setattr(warmstart, "given_model", lambda d: ({}, ""))
    stopped = lambda p, *a, **k: RunSummary(ok=False, error=error, steps=steps, plan=p)  # noqa: E731
    monkeypatch.setattr(training, "run_training", stopped)
    monkeypatch.setattr(swarm_demo, "stack_figures", lambda s: {})
    evaluated: list[str] = []

    def evaluate(arm, name, p, arm_dir, init_dir, args, report, console):  # type: ignore[no-untyped-def]
        evaluated.append(name)
        report[f"after/{name}/heldout"] = {"accuracy": 0.5}
        return None

    monkeypatch.setattr(swarm_demo, "evaluate_entry", evaluate)
    args = _demo_args(
        tmp_path,
        swarm_arm="single",
        init_model=model,
        swarm_rl_budgets=None,
        no_live=True,
        traces=False,
        summary_json=None,
        swarm_budget_tasks=0,
        restart="on-failure",
        max_restarts=3,
    )
    assert swarm_demo.run(demo_plan("swarm"), args) == 1  # a stopped run is still a failed run
    report = json.loads((tmp_path / "run" / "swarm.json").read_text())
    if steps:  # versions were stored: the last one is the run's after, marked
        assert evaluated == ["single"] and report["single"]["rl_stopped_at_step"] == 7
        assert report["after/single/heldout"] == {"accuracy": 0.5}
    else:  # nothing trained: nothing to evaluate
        assert evaluated == [] and "rl_stopped_at_step" not in report["single"]


def test_the_rollouts_latency_is_the_learners_wall_clock_per_episode_at_each_end_of_the_run() -> None:
    # the learner averages the swarm env's wall_ms per step unless a plan says otherwise
    assert "wall_ms" in LearnerConfig().learner.step_means
    steps = [{"step": 0}] + [{"step": s, "episode_means": {"wall_ms": 1000.0 * s}} for s in range(1, 26)]
    lat = swarm_demo.rollouts_latency(steps, window=10)
    assert lat == {"first": 5.5, "last": 20.5, "window": 10, "steps": 25}  # steps 1-10 and 16-25, in seconds
    assert swarm_demo.rollouts_latency([{"step": 1, "episode_means": {"subagents": 1.0}}]) == {}
    curve = swarm_demo.parallelism_curve(type("S", (), {"steps_log": steps})())
    assert curve[2]["latency_s"] == 3.0


def test_swarm_pool_puts_the_swarm_arms_sub_agents_on_the_pool_and_a_bad_count_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import slipstream.run.training as training
    import slipstream.run.warmstart as warmstart
    from slipstream.run.plan import RunSummary

    assert swarm_demo.run(demo_plan("swarm"), _demo_args(tmp_path, swarm_arm="swarm", swarm_pool=-1)) == 2
    assert "--swarm-pool must be >= 0 replicas, got -1" in capsys.readouterr().out
    assert not (tmp_path / "run").exists()

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    plans: dict[str, object] = {}

    def train(p, arm_dir, **k):  # type: ignore[no-untyped-def]
        plans[p.env_options["mode"]] = p
        return RunSummary(ok=False, error="stopped", steps=0, plan=p)

    monkeypatch.setattr(warmstart, "given_model", lambda d: ({}, ""))
    monkeypatch.setattr(training, "run_training", train)
    monkeypatch.setattr(swarm_demo, "stack_figures", lambda s: {})
    common = {
        "init_model": model,
        "swarm_rl_budgets": None,
        "no_live": True,
        "traces": False,
        "summary_json": None,
        "swarm_budget_tasks": 0,
        "restart": "on-failure",
        "max_restarts": 3,
    }
    for arm, replicas, where in (("swarm", 2, "pool x2"), ("single", 0, "none")):
        run_dir = tmp_path / arm
        args = _demo_args(tmp_path, swarm_arm=arm, swarm_pool=2, **common)
        args.run_dir = run_dir  # type: ignore[attr-defined]
        assert swarm_demo.run(demo_plan("swarm"), args) == 1  # stopped before a step: a failed run
        plan = plans[arm]
        assert plan.subagent_pool_replicas == replicas  # type: ignore[attr-defined]
        environ = service_env(plan, Path("/m"), Path("/s"), Path("/o"))
        assert (environ.get("SLIPSTREAM_SUBAGENTS__TRANSPORT") == "nats") == (arm == "swarm")
        assert json.loads((run_dir / "swarm.json").read_text())[arm]["subagents_on"] == where
