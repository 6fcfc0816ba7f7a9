"""The `slipstream` command line: sub-commands, flag validation, and the env a service is given."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from slipstream.bench import main as bench
from slipstream.bus.config import BusConfig
from slipstream.cli.__main__ import COMMANDS, build_parser, main
from slipstream.runtime.section import ServiceSection
from slipstream.stack.handles import ServerHandle
from slipstream.stack.local import OWNED_ENV, OWNED_WHEN_SECURE, Stack, StackError
from slipstream.stack.spec import (
    SERVICES,
    StackSpec,
    StoreSpec,
    default_run_dir,
    parse_services,
    parse_store,
    restart_policy,
    spec_from_args,
)
from slipstream.stack.supervisor import NO_RESTART, RestartPolicy
from slipstream.store.config import StoreConfig
from slipstream.telemetry.config import TelemetryConfig

pytestmark = pytest.mark.unit


def _parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("up", "demo", "bench"):
        assert f"    {name} " in out
    assert {"up", "demo", "bench", "status", "top", "report"} <= set(COMMANDS)


def test_no_command_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_building_the_parser_imports_nothing_heavy() -> None:
    # `slipstream --help` must stay instant: rich, the stack, the run driver, the benches, chaos and the
    # service libs load only in `run` (the flags' own modules, e.g. slipstream.stack.spec, are light).
    code = (
        "import sys; from slipstream.cli.__main__ import build_parser; build_parser();"
        "heavy = ('rich', 'torch', 'nats', 'redis', 'msgspec', 'slipstream.stack.local', 'slipstream.run.training',"
        " 'slipstream.run.plan', 'slipstream.bench', 'slipstream.chaos.suite', 'slipstream.bus');"
        "print(sorted(m for m in sys.modules if m in heavy or m.startswith(tuple(h + '.' for h in heavy))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30)
    assert out.stdout.strip() == "[]"


def test_store_flag_local_and_s3() -> None:
    assert parse_store("/data/store") == StoreSpec(type="local", root="/data/store")
    assert parse_store("s3://bucket-1/runs/a/") == StoreSpec(type="s3", url="s3://bucket-1/runs/a")
    assert parse_store("s3://bucket-1") == StoreSpec(type="s3", url="s3://bucket-1")
    args = build_parser().parse_args(["up", "--store", "s3://b1b/p", "--s3-endpoint", "http://127.0.0.1:9000/"])
    spec = spec_from_args(args, args.parser)
    assert spec.store == StoreSpec(type="s3", url="s3://b1b/p", endpoint_url="http://127.0.0.1:9000")
    assert spec.store.env() == {
        "SLIPSTREAM_STORE__TYPE": "s3",
        "SLIPSTREAM_STORE__URL": "s3://b1b/p",
        "SLIPSTREAM_STORE__ENDPOINT_URL": "http://127.0.0.1:9000",
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("s3://", "has no bucket"),
        ("s3:///prefix", "has no bucket"),
        ("s3://Bad_Bucket/p", "'Bad_Bucket' is not a valid S3 bucket name"),
        ("gs://bucket/p", "unsupported store URL scheme 'gs'"),
        ("s3://bucket/p?x=1", "query or fragment"),
    ],
)
def test_bad_store_url_is_a_clear_error(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(["up", "--store", value], capsys)
    assert "--store" in err
    assert message in err


def test_s3_endpoint_needs_an_s3_store(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["up", "--store", "/tmp/x", "--s3-endpoint", "http://127.0.0.1:9000"])
    with pytest.raises(SystemExit):
        spec_from_args(args, args.parser)
    assert "--s3-endpoint needs an S3 store" in capsys.readouterr().err
    assert "is not an http(s)://host[:port] URL" in _parse_error(["up", "--s3-endpoint", "ftp://x"], capsys)


def test_services_flag() -> None:
    assert parse_services("learner,reward_model") == ("reward-model", "learner")  # start order, canonical names
    assert parse_services("eval-gate, eval_gate") == ("eval-gate",)
    assert parse_services("none") == ()
    assert parse_services("all") == SERVICES
    assert build_parser().parse_args(["up"]).services == SERVICES
    assert len(SERVICES) == 6 and "task-source" in SERVICES


def test_unknown_service_names_it_and_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    err = _parse_error(["up", "--services", "learner,trainer"], capsys)
    assert "unknown service 'trainer'" in err
    for name in SERVICES:
        assert name in err
    with pytest.raises(argparse.ArgumentTypeError, match="no service named"):
        parse_services(",")


def test_server_urls_and_env_flags_are_validated(capsys: pytest.CaptureFixture[str]) -> None:
    assert "NATS URL 'http://x:1' must look like nats://host:port" in _parse_error(
        ["up", "--nats-url", "http://x:1"], capsys
    )
    assert "Port out of range" in _parse_error(["up", "--redis-url", "redis://h:99999"], capsys)
    assert "expected SLIPSTREAM_<SECTION>__<FIELD>=VALUE" in _parse_error(["up", "--env", "FOO=1"], capsys)
    assert "must be > 0" in _parse_error(["up", "--ready-timeout", "0"], capsys)
    args = build_parser().parse_args(["up", "--env", "SLIPSTREAM_LEARNER__LR=1e-5", "--env", "SLIPSTREAM_A__B=x=y"])
    assert dict(args.env) == {"SLIPSTREAM_LEARNER__LR": "1e-5", "SLIPSTREAM_A__B": "x=y"}


def test_restart_flags_on_up_demo_and_train(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["up"])
    assert spec_from_args(args, args.parser).restart == RestartPolicy()
    args = build_parser().parse_args(["up", "--no-restart"])
    assert not spec_from_args(args, args.parser).restart.enabled
    args = build_parser().parse_args(["up", "--max-restarts", "0"])
    assert spec_from_args(args, args.parser).restart.max_restarts == 0
    assert restart_policy(build_parser().parse_args(["demo", "--no-restart"])) == NO_RESTART
    assert restart_policy(build_parser().parse_args(["train", "x.toml", "--max-restarts", "2"])).max_restarts == 2
    assert "'-1' must be >= 0" in _parse_error(["demo", "--max-restarts", "-1"], capsys)


def test_default_run_dir_does_not_reuse_a_taken_second(tmp_path: Path) -> None:
    first = default_run_dir(tmp_path, now=0)
    assert first.parent == tmp_path / "runs"
    first.mkdir(parents=True)
    second = default_run_dir(tmp_path, now=0)
    assert second == first.with_name(first.name + "-2")


def test_a_run_dir_that_holds_an_earlier_run_is_refused_before_anything_starts(tmp_path: Path) -> None:
    from slipstream.run.plan import TrainingPlan
    from slipstream.run.training import earlier_run, run_training

    fresh = tmp_path / "fresh"
    assert earlier_run(fresh) == ""  # not there yet
    fresh.mkdir()
    (fresh / "data").mkdir()  # an empty folder is no run
    assert earlier_run(fresh) == ""
    old = tmp_path / "old"
    (old / "data" / "store").mkdir(parents=True)
    summary = run_training(TrainingPlan(), old)
    assert (
        not summary.ok
        and summary.error == f"run dir {old} already holds a run (data): pick another --run-dir or remove it"
    )
    assert sorted(p.name for p in old.iterdir()) == ["data"]  # no warm-start, no stack, no summary written
    (fresh / "summary.json").write_text("{}")
    assert earlier_run(fresh) == "summary.json"


def test_the_task_screen_on_another_engine_is_refused_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `SLIPSTREAM_ENGINE__TYPE=vllm slipstream demo`: the demo's plan keeps its screen, which only the
    # torch engine can run; the workers used to fail in setup, after the warm-start and their engines.
    from slipstream.run.plan import TrainingPlan, engine_conflict
    from slipstream.run.training import run_training

    screened = TrainingPlan(screen_target=0.8)
    monkeypatch.setenv("SLIPSTREAM_ENGINE__TYPE", "vllm")
    summary = run_training(screened, tmp_path / "run")
    assert not summary.ok and summary.error.startswith("the task screen (screen_target = 0.8) needs the torch engine")
    assert "SLIPSTREAM_ENGINE__TYPE is 'vllm'" in summary.error and "--screen 0" in summary.error
    assert not (tmp_path / "run").exists()  # no warm-start, no stack
    # The plan's own [engine] type wins over the inherited variable, and is named as the source.
    assert "[engine] type is 'http'" in engine_conflict(TrainingPlan(screen_target=0.5, engine={"type": "http"}), {})
    assert (
        engine_conflict(TrainingPlan(screen_target=0.8, engine={"type": "torch"}), {"SLIPSTREAM_ENGINE__TYPE": "vllm"})
        == ""
    )
    assert engine_conflict(TrainingPlan(screen_target=0.0), {"SLIPSTREAM_ENGINE__TYPE": "vllm"}) == ""
    assert engine_conflict(screened, {}) == ""


def test_spec_normalized_fills_store_run_id_and_trace_files(tmp_path: Path) -> None:
    spec = StackSpec(run_dir=tmp_path / "r7", traces=tmp_path / "t" / "traces.jsonl").normalized()
    assert spec.run_id == "r7"
    assert spec.store == StoreSpec(type="local", root=str(tmp_path / "r7" / "data" / "store"))
    assert spec.traces_file("reward-model") == tmp_path / "t" / "traces.reward-model.jsonl"
    assert StackSpec(run_dir=tmp_path).traces_file("learner") is None


def _stack_with_fake_servers(tmp_path: Path, **kw: object) -> Stack:
    stack = Stack(StackSpec(run_dir=tmp_path / "run", run_id="r1", drain_timeout_s=7.5, **kw))  # type: ignore[arg-type]
    stack.servers = {
        "nats": ServerHandle("nats", "nats://127.0.0.1:14222", None),
        "redis": ServerHandle("redis", "redis://127.0.0.1:16379/0", None),
    }
    return stack


def test_service_env_maps_onto_config_fields(tmp_path: Path) -> None:
    stack = _stack_with_fake_servers(
        tmp_path, traces=tmp_path / "tr.jsonl", env={"SLIPSTREAM_TELEMETRY__LOG_LEVEL": "debug"}
    )
    env = stack.service_env("learner", 18080)
    assert env["SLIPSTREAM_BUS__URL"] == "nats://127.0.0.1:14222"
    # The learner's own users (the stack makes fresh passwords per run).
    assert stack.credentials is not None
    learner_pw = stack.credentials.redis["learner"]
    assert env["SLIPSTREAM_SERVICE__REDIS_URL"] == f"redis://learner:{learner_pw}@127.0.0.1:16379/0"
    assert env["SLIPSTREAM_BUS__USER"] == "learner"
    assert env["SLIPSTREAM_BUS__PASSWORD"] == stack.credentials.nats["learner"]
    assert stack.credentials.nats["learner"] != stack.credentials.nats["reward-model"]
    assert env["SLIPSTREAM_SERVICE__HTTP_PORT"] == "18080"
    assert env["SLIPSTREAM_SERVICE__RUN_ID"] == "r1"
    assert env["SLIPSTREAM_SERVICE__DRAIN_TIMEOUT_S"] == "7.5"
    assert env["SLIPSTREAM_STORE__TYPE"] == "local"
    assert env["SLIPSTREAM_STORE__ROOT"] == str(tmp_path / "run" / "data" / "store")
    assert env["SLIPSTREAM_TELEMETRY__LOG_FORMAT"] == "json"
    assert env["SLIPSTREAM_TELEMETRY__LOG_LEVEL"] == "debug"
    assert env["SLIPSTREAM_TELEMETRY__TRACES"] == "file"
    assert env["SLIPSTREAM_TELEMETRY__TRACES_FILE"] == str(tmp_path / "tr.learner.jsonl")
    # Every SLIPSTREAM_ variable the stack sets names a real field of the section that owns it.
    sections: dict[str, type[msgspec.Struct]] = {
        "bus": BusConfig,
        "store": StoreConfig,
        "service": ServiceSection,
        "telemetry": TelemetryConfig,
    }
    owned = [*OWNED_ENV, *OWNED_WHEN_SECURE]
    for key in [*owned, *(k for k in env if k.startswith("SLIPSTREAM_") and k not in stack.spec.env)]:
        section, _, field = key.removeprefix("SLIPSTREAM_").lower().partition("__")
        assert field in sections[section].__struct_fields__, key


def test_an_insecure_stack_hands_out_no_credentials(tmp_path: Path) -> None:
    stack = _stack_with_fake_servers(tmp_path, secure=False)
    env = stack.service_env("learner", 18080)
    assert stack.credentials is None
    assert env["SLIPSTREAM_SERVICE__REDIS_URL"] == "redis://127.0.0.1:16379/0"
    assert env.get("SLIPSTREAM_BUS__USER", "") == os.environ.get("SLIPSTREAM_BUS__USER", "")
    assert stack.info()["credentials_file"] is None


def test_env_flag_cannot_override_what_the_stack_sets(tmp_path: Path) -> None:
    stack = Stack(StackSpec(run_dir=tmp_path / "run", services=(), env={"SLIPSTREAM_BUS__URL": "nats://x:1"}))
    with pytest.raises(StackError, match="SLIPSTREAM_BUS__URL is set by the stack itself"):
        stack.start()
    assert not (tmp_path / "run").exists()  # refused before anything started


def test_bench_reports_a_missing_module(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(bench, "BENCHES", {"nope": "nope_not_here"})
    with pytest.raises(SystemExit) as exc:
        main(["bench", "nope", "--json", "x.json"])
    assert exc.value.code == 2
    assert "'nope' is not available: module slipstream.bench.nope_not_here is missing" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    help_text = " ".join(capsys.readouterr().out.split())  # argparse wraps long help lines
    assert "nope (unavailable: module slipstream.bench.nope_not_here is missing)" in help_text


def test_bench_runs_a_registered_module(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    calls: list[list[str]] = []

    class FakeBench:
        @staticmethod
        def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
            p = sub.add_parser("fake")
            p.add_argument("--json", type=Path)
            p.set_defaults(func=lambda a: calls.append([str(a.json)]) or 3)

    monkeypatch.setitem(sys.modules, "slipstream.bench.fake", FakeBench)
    monkeypatch.setattr(bench, "BENCHES", {"fake": "fake"})
    assert main(["bench", "fake", "--json", str(tmp_path / "b.json")]) == 3
    assert calls == [[str(tmp_path / "b.json")]]


def test_unknown_flag_is_an_error_of_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["up", "--detach"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "usage: slipstream up" in err
    assert "unrecognized arguments: --detach" in err


def test_each_run_gets_a_signing_key_only_the_publisher_holds(tmp_path: Path) -> None:
    from slipstream.trust import Keyring, generate_keypair, load_signing_key

    stack = _stack_with_fake_servers(tmp_path)
    stack._trust = stack._run_key()
    key_file = tmp_path / "run" / "data" / "keys" / "weights-signing.pem"
    assert key_file.stat().st_mode & 0o777 == 0o600
    key = load_signing_key(key_file)
    assert stack.signing_key_id == key.key_id and stack.info()["signing_key_id"] == key.key_id
    publisher, worker = stack.service_env("weight-publisher", 1), stack.service_env("rollout-worker", 2)
    assert publisher["SLIPSTREAM_TRUST__SIGNING_KEY"] == str(key_file)
    assert "SLIPSTREAM_TRUST__SIGNING_KEY" not in worker
    trusted = json.loads(worker["SLIPSTREAM_TRUST__TRUSTED_KEYS"])
    assert Keyring.parse(trusted).ids == [key.key_id]
    # The same run directory keeps its key (a restarted stack verifies what it signed before).
    assert _stack_with_fake_servers(tmp_path)._run_key() == stack._trust
    # A key of the operator's own (--env) replaces the run's, and its public half is trusted.
    own = tmp_path / "own.pem"
    mine = generate_keypair(own)
    other = _stack_with_fake_servers(tmp_path, env={"SLIPSTREAM_TRUST__SIGNING_KEY": str(own)})
    other._trust = other._run_key()
    assert other.signing_key_id == mine.key_id
    assert json.loads(other.service_env("task-source", 3)["SLIPSTREAM_TRUST__TRUSTED_KEYS"]) == [mine.public]


def test_learner_ranks_start_one_weight_publisher_per_rank(tmp_path: Path) -> None:
    from slipstream.runtime.config import resolve
    from slipstream.weight_publisher.config import WeightPublisherConfig

    # Asked for by the run's config variables (a run file's [learner] ranks renders to this one).
    stack = _stack_with_fake_servers(tmp_path, env={"SLIPSTREAM_LEARNER__RANKS": "2"})
    assert stack.spec.learner_ranks == 2
    names = stack.spec.process_names()
    assert names == (
        "rollout-worker",
        "reward-model",
        "learner",
        "weight-publisher",
        "weight-publisher-1",
        "eval-gate",
        "task-source",
    )
    stack._trust = stack._run_key()
    configs = [resolve(WeightPublisherConfig, environ=stack.service_env(n, 1)) for n in names if "publisher" in n]
    assert [(c.publisher.rank, c.publisher.ranks) for c in configs] == [(0, 2), (1, 2)]
    # Both sign with the run's key and connect as the weight-publisher's own user.
    second = stack.service_env("weight-publisher-1", 1)
    assert (
        second["SLIPSTREAM_TRUST__SIGNING_KEY"]
        == stack.service_env("weight-publisher", 2)["SLIPSTREAM_TRUST__SIGNING_KEY"]
    )
    assert second["SLIPSTREAM_BUS__USER"] == "weight-publisher"
    assert stack.service_env("learner", 3)["SLIPSTREAM_LEARNER__RANKS"] == "2"
    # One rank: one publisher, told nothing about ranks (the classic whole-version path).
    one = _stack_with_fake_servers(tmp_path / "one")
    assert (
        one.spec.process_names().count("weight-publisher") == 1 and "weight-publisher-1" not in one.spec.process_names()
    )
    assert "SLIPSTREAM_PUBLISHER__RANK" not in one.service_env("weight-publisher", 1)
    with pytest.raises(ValueError, match="SLIPSTREAM_LEARNER__RANKS='two' is not a whole number"):
        _stack_with_fake_servers(tmp_path / "bad", env={"SLIPSTREAM_LEARNER__RANKS": "two"})


def test_pool_replicas_run_the_rollout_worker_pinned_as_their_own_user(tmp_path: Path) -> None:
    from slipstream.rollout_worker.config import RolloutWorkerConfig
    from slipstream.runtime.config import resolve
    from slipstream.stack.spec import module_of, pool_replica_names

    stack = _stack_with_fake_servers(
        tmp_path,
        services=("rollout-worker",),
        subagent_pool=2,
        pin_version=3,
        service_env={"rollout-worker": {"SLIPSTREAM_MODEL__PRESET": "25m"}},
    )
    assert pool_replica_names(2) == ("subagent-pool", "subagent-pool-2")
    assert module_of("subagent-pool") == "slipstream.rollout_worker"
    pool = resolve(RolloutWorkerConfig, environ=stack.service_env("subagent-pool-2", 1))
    worker = resolve(RolloutWorkerConfig, environ=stack.service_env("rollout-worker", 2))
    assert pool.pool.subagents and pool.pool.pin_version == 3 and pool.service.replica == "subagent-pool-2"
    assert pool.bus.user == "subagent-pool" and pool.model.preset == "25m" == worker.model.preset
    assert worker.subagents.transport == "nats" and not worker.pool.subagents
    assert worker.bus.user == "rollout-worker"
    # Without a pool the workers keep their sub-agents local.
    alone = _stack_with_fake_servers(tmp_path / "alone", services=("rollout-worker",))
    assert resolve(RolloutWorkerConfig, environ=alone.service_env("rollout-worker", 2)).subagents.transport == "local"
