"""The run file: strict loading with the key's line, one plan for every service, and one source for
the local stack, the dev overlay and Tilt."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from deploy_helpers import render

from slipstream.run import RunFileError, env_file, load, parse_env_file, run_env, service_env, service_overrides
from slipstream.runtime.config import resolve

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.toml"))
DEV_RUN = REPO / "examples" / "arith.toml"
DEV_RUN_ENV = REPO / "deploy" / "k8s" / "overlays" / "dev" / "run.env"
CONFIG_CLASSES = importlib.import_module("slipstream.cli.train").CONFIG_CLASSES
# examples/verifiers.toml names verifiers' own venv, which `make verifiers-venv` builds (not `make
# install`): its options are refused at load without it, by design (the run fails before it starts).
VF_PYTHON = REPO / ".venv-vf" / "bin" / "python"


def _loadable(path: Path) -> Path:
    if path.stem == "verifiers" and not VF_PYTHON.exists():
        pytest.skip(f"{path.name} needs verifiers' venv {VF_PYTHON} (make verifiers-venv)")
    return path


def test_every_shipped_environment_has_an_example_run_file() -> None:
    from slipstream.envs import ENVIRONMENTS, task_envs

    # Not `serve` (no tasks: it scores recorded traffic) nor humaneval (an eval suite).
    trainable = {name for name in task_envs() if not ENVIRONMENTS[name].eval_only}
    named = {tomllib.loads(p.read_text())["env"]["name"] for p in EXAMPLES}
    assert named >= trainable
    assert {p.stem for p in EXAMPLES} >= named


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_one_run_file_resolves_into_every_services_config(path: Path) -> None:
    run = load(_loadable(path))
    plan = run.plan()
    environ = service_env(plan, Path("/m"), Path("/staging"), Path("/outcomes.jsonl"))
    overrides = service_overrides(plan)
    configs = {}
    for service, target in CONFIG_CLASSES.items():
        module, _, name = target.partition(":")
        cls = getattr(importlib.import_module(module), name)
        configs[service] = resolve(cls, environ={**environ, **overrides.get(service, {})})
    learner, tasks, worker, gate = (configs[s] for s in ("learner", "task-source", "rollout-worker", "eval-gate"))
    # The same run everywhere: pacing, staleness, sampling temperature, environment and its options.
    assert learner.learner.max_steps == tasks.tasks.max_steps == plan.max_steps  # type: ignore[attr-defined]
    assert learner.learner.groups_per_step == tasks.tasks.groups_per_step == plan.groups_per_step  # type: ignore[attr-defined]
    assert learner.learner.max_staleness == tasks.tasks.max_staleness == plan.max_staleness  # type: ignore[attr-defined]
    assert learner.learner.lr == plan.lr and learner.loss.type == plan.loss  # type: ignore[attr-defined]
    assert worker.worker.temperature == learner.learner.sampling_temperature == plan.temperature  # type: ignore[attr-defined]
    assert tasks.tasks.envs == gate.gate.envs == [plan.env] and tasks.tasks.group_size == plan.group_size  # type: ignore[attr-defined]
    if plan.env_options:
        assert worker.worker.env_options == gate.gate.env_options == {plan.env: plan.env_options}  # type: ignore[attr-defined]
    assert worker.model.dtype == plan.rollout_dtype and worker.model.lora_rank == plan.lora_rank  # type: ignore[attr-defined]


def test_the_dev_overlay_and_tilt_carry_the_dev_run_file() -> None:
    # The committed env file is the dev run file's rendering (re-render it when either changes).
    assert DEV_RUN_ENV.read_text() == env_file(load(DEV_RUN)), (
        "deploy/k8s/overlays/dev/run.env is stale: run "
        "`slipstream train examples/arith.toml --env-file deploy/k8s/overlays/dev/run.env`"
    )
    expected = run_env(load(DEV_RUN).plan())
    configmap = next(
        o for o in render("dev") if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("slipstream-env")
    )
    assert {k: configmap["data"][k] for k in expected} == expected
    tilt = importlib.import_module("tilt_harness") if "tilt_harness" in sys.modules else None
    if tilt is None:
        spec = importlib.util.spec_from_file_location("tilt_harness", REPO / "deploy/tools/tilt_harness.py")
        assert spec and spec.loader
        tilt = importlib.util.module_from_spec(spec)
        sys.modules["tilt_harness"] = tilt
        spec.loader.exec_module(tilt)
    local = tilt.evaluate(REPO / "Tiltfile", ["--local"])
    for call in local.of("local_resource"):
        if call.args["name"] != "stack":
            env = call.args["serve_env"]
            assert {k: env[k] for k in expected} == expected, call.args["name"]


def test_env_file_round_trips() -> None:
    run = load(DEV_RUN)
    assert parse_env_file(env_file(run)) == run_env(run.plan())


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ('name = "x"\n\n[algorithm]\nloss = "grpo"\nlrr = 1e-4\n', 5, "unknown key [algorithm] 'lrr'"),
        ('nmae = "x"\n', 1, "unknown key 'nmae'"),
        ('[batch]\ngroup_size = 8\nmax_steps = "ten"\n', 3, "batch.max_steps"),
        ("[replicas]\nrollout-worker = 2\nlearner = 2\n", 3, "unknown key [replicas] 'learner'"),
        ('[model]\npreset = "tiny"\n[modle]\nname = "x"\n', 3, "unknown key 'modle'"),
    ],
)
def test_a_bad_key_names_the_key_the_file_and_the_line(tmp_path: Path, body: str, line: int, words: str) -> None:
    path = tmp_path / "run.toml"
    path.write_text(body)
    with pytest.raises(RunFileError) as info:
        load(path)
    message = str(info.value)
    assert message.startswith(f"{path}:{line}: ") and words in message, message


def test_train_refuses_a_bad_run_file_before_starting_anything(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text("[algorithm]\nlearning_rate = 1e-4\n")
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "train", str(path), "--run-dir", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert f"{path}:2: unknown key [algorithm] 'learning_rate'" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_print_config_shows_every_service(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "train", str(DEV_RUN), "--print-config"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    headers = [line for line in proc.stdout.splitlines() if line.startswith("# ")]
    assert headers == [f"# {s} (replicas: {n})" for s, n in zip(CONFIG_CLASSES, (2, 1, 1, 1, 1, 1), strict=True)]
    # Brief by default: the fields the run sets, one a line, and how many stay at their defaults.
    assert 'worker.env_options = {"arith": {"max_operand": 19, "ops": "+"}}' in proc.stdout
    assert "learner.max_steps = 200" in proc.stdout
    assert "bus.connect_timeout_s" not in proc.stdout
    assert len(proc.stdout.splitlines()) < 80
    kept = [int(line.split()[0][1:]) for line in proc.stdout.splitlines() if line.endswith("at their defaults)")]
    assert len(kept) == 6 and min(kept) > 20
    full = subprocess.run(
        [sys.executable, "-m", "slipstream.cli", "train", str(DEV_RUN), "--print-config", "full"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert full.returncode == 0, full.stderr
    assert '"max_operand": 19' in full.stdout and '"connect_timeout_s": 2.0' in full.stdout


def test_the_brief_config_lists_the_fields_that_differ_from_the_defaults() -> None:
    from slipstream.cli.train import changed_fields
    from slipstream.runtime.config import resolve
    from slipstream.task_source.config import TaskSourceConfig

    default = resolve(TaskSourceConfig, environ={})
    cfg = resolve(TaskSourceConfig, environ={"SLIPSTREAM_TASKS__MAX_STEPS": "7", "SLIPSTREAM_BUS__PASSWORD": "secret"})
    assert changed_fields(default, default) == {}
    assert changed_fields(cfg, default) == {"tasks.max_steps": 7, "bus.password": "***"}


def test_a_run_asking_for_tool_service_replicas_points_the_workers_at_them(tmp_path: Path) -> None:
    from slipstream.rollout_worker.config import RolloutWorkerConfig
    from slipstream.tool_service.config import ToolServiceConfig

    path = tmp_path / "remote.toml"
    path.write_text('[env]\nname = "lookup"\noptions = {salt = "s1"}\n[replicas]\ntool-service = 2\n')
    plan = load(path).plan()
    assert plan.tool_service_replicas == 2
    environ = service_env(plan, Path("/m"), Path("/staging"), Path("/outcomes.jsonl"))
    worker = resolve(RolloutWorkerConfig, environ=environ)
    served = resolve(ToolServiceConfig, environ=environ)
    assert worker.tools.transport == "nats"
    # The replicas build the env's tools exactly as the workers build the env: same options.
    assert served.serve.sets == ["lookup"] and served.serve.options == worker.worker.env_options == {
        "lookup": {"salt": "s1"}
    }
    # Without the key nothing changes: tools run in the workers.
    local = resolve(RolloutWorkerConfig, environ=service_env(load(DEV_RUN).plan(), Path("/m"), Path("/s"), Path("/o")))
    assert local.tools.transport == "local"


def test_a_run_asking_for_a_subagent_pool_sends_the_workers_sub_agents_there(tmp_path: Path) -> None:
    from slipstream.rollout_worker.config import RolloutWorkerConfig

    path = tmp_path / "pool.toml"
    path.write_text('[env]\nname = "lookup"\n[replicas]\nsubagent-pool = 3\n')
    plan = load(path).plan()
    assert plan.subagent_pool_replicas == 3 and plan.subagent_pin_version == 0
    worker = resolve(RolloutWorkerConfig, environ=service_env(plan, Path("/m"), Path("/s"), Path("/o")))
    assert worker.subagents.transport == "nats" and not worker.pool.subagents
    local = resolve(RolloutWorkerConfig, environ=service_env(load(DEV_RUN).plan(), Path("/m"), Path("/s"), Path("/o")))
    assert local.subagents.transport == "local"


def test_the_demo_plans_are_the_example_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`slipstream demo --env ENV` trains examples/ENV.toml for every env with a demo plan (the one
    place it is defined; the e2e suite's shared demo run covers the file's path: tests/e2e/test_run_files.py,
    RUN_ELSEWHERE), and TrainingPlan's defaults on any other env."""
    from slipstream.run.plan import TrainingPlan
    from slipstream.run.presets import PRESETS, demo_plan, examples_dir

    assert examples_dir() == REPO / "examples"
    assert {"reverse", "lookup", "search", "swarm", "recall", "code"} <= set(PRESETS)
    for env in PRESETS:
        assert demo_plan(env) == load(REPO / "examples" / f"{env}.toml").plan(), env
        assert demo_plan(env).env == env
    assert demo_plan() == demo_plan("reverse")
    assert demo_plan("arith") == TrainingPlan(eval_every=15, env="arith")
    swarm = demo_plan("swarm")
    assert set(swarm.reward_schedule) == {"parallel", "finish"}  # the λ schedule comes with the file
    assert demo_plan("recall").summary["mode"] == "summary"
    # A change to the file is a change to the demo: nothing else holds the plan.
    (tmp_path / "reverse.toml").write_text('[env]\nname = "reverse"\n[batch]\nmax_steps = 7\n')
    monkeypatch.setenv("SLIPSTREAM_EXAMPLES", str(tmp_path))
    assert demo_plan().max_steps == 7
    with pytest.raises(FileNotFoundError, match="lookup demo's plan"):
        demo_plan("lookup")


def test_the_search_call_example_trains_what_the_real_model_e2e_runs() -> None:
    """examples/search_call.toml is the real-model demo's model, env, LoRA and rollout precision
    (tests/e2e/test_real_model_training.py runs that path; the example only steps on fewer groups)."""
    from slipstream.run.presets import pretrained_plan

    example, demo = load(REPO / "examples" / "search_call.toml").plan(), pretrained_plan("smollm2-135m")
    fields = ("model", "env", "loss", "lora_rank", "lora_alpha", "rollout_dtype", "learner_autocast", "group_size")
    assert {f: getattr(example, f) for f in fields} == {f: getattr(demo, f) for f in fields}


def test_rollout_summary_reaches_the_workers_and_the_learner(tmp_path: Path) -> None:
    from slipstream.harness.summary import SummaryConfig
    from slipstream.learner.config import LearnerConfig
    from slipstream.rollout_worker.config import RolloutWorkerConfig

    path = tmp_path / "summary.toml"
    path.write_text(
        '[env]\nname = "recall"\n[rollout.summary]\nmode = "truncate"\nmin_tokens = 60\nmax_tokens = 90\n'
        'summary_tokens = 20\nrequest = "\\n<summary>"\nstop = ["</summary>", "\\n\\n"]\nloss_weighting = "episode"\n'
    )
    plan = load(path).plan()
    # A [rollout.summary] table turns restarts on; loss_weighting is the learner's, not the workers'.
    assert plan.summary == {
        "enabled": True,
        "mode": "truncate",
        "min_tokens": 60,
        "max_tokens": 90,
        "summary_tokens": 20,
        "request": "\n<summary>",
        "stop": ["</summary>", "\n\n"],
    }
    assert plan.sample_weighting == "episode"
    environ = service_env(plan, Path("/m"), Path("/staging"), Path("/outcomes.jsonl"))
    worker = resolve(RolloutWorkerConfig, environ=environ)
    assert worker.summary == SummaryConfig(
        enabled=True,
        mode="truncate",
        min_tokens=60,
        max_tokens=90,
        summary_tokens=20,
        request="\n<summary>",
        stop=("</summary>", "\n\n"),
    )
    assert resolve(LearnerConfig, environ=environ).learner.sample_weighting == "episode"
    # Without the table: no restarts, token weighting.
    plain = service_env(load(DEV_RUN).plan(), Path("/m"), Path("/s"), Path("/o"))
    assert not resolve(RolloutWorkerConfig, environ=plain).summary.enabled
    assert resolve(LearnerConfig, environ=plain).learner.sample_weighting == "token"


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ('[rollout.summary]\nmode = "drop"\n', "rollout.summary.mode"),
        ("[rollout.summary]\nthreshold = 5\n", "unknown key [rollout.summary] 'threshold'"),
        ('[rollout.summary]\nloss_weighting = "link"\n', "rollout.summary.loss_weighting"),
    ],
)
def test_a_bad_summary_key_is_named(tmp_path: Path, body: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(RunFileError, match=re.escape(words)):
        load(path)


def test_a_summary_the_services_cannot_use_fails_before_anything_starts() -> None:
    from slipstream.rollout_worker.sampler import check_summary
    from slipstream.run import TrainingPlan
    from slipstream.run.summary_plan import summary_config

    with pytest.raises(ValueError, match="min_tokens <= max_tokens"):
        summary_config(TrainingPlan(summary={"enabled": True, "min_tokens": 90, "max_tokens": 60}))
    config = summary_config(
        TrainingPlan(summary={"enabled": True, "min_tokens": 100, "max_tokens": 900, "summary_tokens": 64})
    )
    with pytest.raises(ValueError, match=re.escape("does not fit worker.max_seq_len 512")):
        check_summary(config, 512, 64)
    with pytest.raises(ValueError, match=re.escape("summary_tokens 64 is more than worker.max_tokens 32")):
        check_summary(config, 0, 32)
    check_summary(config, 2048, 64)
    assert summary_config(TrainingPlan()) is None


def test_learner_ranks_in_a_run_file_reach_the_learner_and_the_stack(tmp_path: Path) -> None:
    import argparse

    from slipstream.cli.up import with_run_file
    from slipstream.learner.config import LearnerConfig
    from slipstream.stack.spec import StackSpec

    path = tmp_path / "ranks.toml"
    path.write_text('name = "ranks"\n[learner]\nranks = 2\n')
    plan = load(path).plan()
    assert plan.learner_ranks == 2
    environ = service_env(plan, Path("/m"), Path("/staging"), Path("/outcomes.jsonl"))
    assert resolve(LearnerConfig, environ=environ).learner.ranks == 2
    # `slipstream up --run` starts a weight-publisher per rank.
    spec = with_run_file(StackSpec(run_dir=tmp_path / "run"), path, argparse.ArgumentParser())
    assert spec.normalized().process_names().count("weight-publisher-1") == 1
    # Without the key: one rank, and the run's config says nothing about ranks.
    assert load(DEV_RUN).plan().learner_ranks == 1
    assert "SLIPSTREAM_LEARNER__RANKS" not in service_env(load(DEV_RUN).plan(), Path("/m"), Path("/s"), Path("/o"))
    path.write_text("[learner]\nranks = 0\n")
    with pytest.raises(ValueError, match=r"\[learner\] ranks must be >= 1, got 0"):
        load(path).plan()
    path.write_text("[learner]\nrank = 2\n")
    with pytest.raises(
        RunFileError,
        match=r"ranks.toml:2: unknown key \[learner\] 'rank' "
        r"\(known: ranks, reward_schedule, toggle, sft_export, sft_export_min_reward, router_replay, moe_aux_coef\)",
    ):
        load(path)


def test_a_reward_schedule_in_the_run_file_reaches_the_learner(tmp_path: Path) -> None:
    from slipstream.learner.config import LearnerConfig
    from slipstream.rl.schedule import ComponentSchedule

    path = tmp_path / "swarm.toml"
    path.write_text(
        '[env]\nname = "arith"\n'
        "[learner.reward_schedule.parallel]\ninit = 0.1\nanneal_steps = 40\n"
        '[learner.reward_schedule.finish]\ninit = 0.1\nanneal_steps = 40\nshape = "cosine"\n'
    )
    plan = load(path).plan()
    assert plan.reward_schedule == {
        "parallel": {"init": 0.1, "anneal_steps": 40},
        "finish": {"init": 0.1, "anneal_steps": 40, "shape": "cosine"},
    }
    environ = service_env(plan, Path("/m"), Path("/staging"), Path("/outcomes.jsonl"))
    learner = resolve(LearnerConfig, environ=environ)
    assert learner.learner.reward_schedule == {
        "parallel": ComponentSchedule(init=0.1, anneal_steps=40),
        "finish": ComponentSchedule(init=0.1, anneal_steps=40, shape="cosine"),
    }
    assert "SLIPSTREAM_LEARNER__REWARD_SCHEDULE" not in run_env(load(DEV_RUN).plan())  # none: nothing set


def test_rollout_screen_target_reaches_the_workers(tmp_path: Path) -> None:
    """[rollout] screen_target becomes the workers' [worker] screen_target; left out, the screen is off."""
    from slipstream.rollout_worker.config import RolloutWorkerConfig

    path = tmp_path / "screen.toml"
    path.write_text('[env]\nname = "reverse"\n[rollout]\nscreen_target = 0.8\n')
    plan = load(path).plan()
    assert plan.screen_target == 0.8
    environ = service_env(plan, Path("/m"), Path("/staging"), Path("/outcomes.jsonl"))
    assert resolve(RolloutWorkerConfig, environ=environ).worker.screen_target == 0.8
    plain = service_env(load(DEV_RUN).plan(), Path("/m"), Path("/s"), Path("/o"))
    assert resolve(RolloutWorkerConfig, environ=plain).worker.screen_target == 0.0
    bad = tmp_path / "bad.toml"
    bad.write_text('[rollout]\nscreen_target = "high"\n')
    with pytest.raises(RunFileError, match="screen_target"):
        load(bad)
