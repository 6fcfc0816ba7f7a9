"""The Tiltfile, evaluated offline by starlark-rust with Tilt's builtins stubbed (both modes).

Cluster mode (`tilt up`): the images it builds must be Dockerfile targets referenced by the dev
overlay, its live_update must sync into the paths the images install from, port-forwards must
reach the ports the services' TOML sets. Local mode (`tilt up -- --local`): one local_resource
per service running `python -m slipstream.<pkg>` against the embedded stack, ready on /readyz.
Every path the Tiltfile names must exist. Also covers deploy/tilt/stack_env.py, the wrapper that
hands the stack's URLs to local services.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from slipstream.runtime import config as runtime_config

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
TILTFILE = REPO / "Tiltfile"
ROLES = {"infra", "tasks", "rollout", "scoring", "training", "eval", "tools"}
INFRA = {"nats", "redis", "minio", "otel-collector", "provision-streams"}


def _load(name: str, path: Path) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


tilt = _load("tilt_harness", REPO / "deploy/tools/tilt_harness.py")
kl = _load("kustomize", REPO / "deploy/tools/kustomize.py")
table = _load("service_table", REPO / "deploy/tools/service_table.py")
images = _load("image_stages", REPO / "deploy/tools/image_stages.py")
podcfg = _load("pod_config", REPO / "deploy/tools/pod_config.py")
stack_env = _load("stack_env", REPO / "deploy/tilt/stack_env.py")


@cache
def evaluate(*args: str) -> Any:
    return tilt.evaluate(TILTFILE, args, environ={})


def toml_port(service: str) -> int:
    path = next((REPO / "deploy/k8s/base").rglob(f"{service}.toml"))
    return int(tomllib.loads(path.read_text())["service"]["http_port"])


def named_paths(run: Any) -> set[str]:
    """Every repository path a Tiltfile call names (contexts, Dockerfiles, syncs, deps, scripts...)."""
    paths: set[str] = set()
    for c in run.calls:
        a = c.args
        if c.name == "docker_build":
            paths |= {a["context"], a["dockerfile"], *(a["only"] or [])}
            for step in a["live_update"] or []:
                if step["__tilt__"] == "sync":
                    paths.add(step["local_path"])
                elif step["__tilt__"] == "run":
                    paths |= set(step["trigger"])
                elif step["__tilt__"] == "fall_back_on":
                    paths |= set(step["files"])
        elif c.name == "kustomize":
            paths.add(a["pathToDir"])
        elif c.name == "local_resource":
            paths |= set(a["deps"] or [])
            paths |= {w for w in str(a["serve_cmd"]).split() if w.startswith(("deploy/", "libs/", "services/"))}
    return paths


# ---------------------------------------------------------------- cluster mode

RESTART_FILE = "/app/.restart-proc"  # the non-root user owns /app, not /


def restart_loop() -> str:
    """The entrypoint's shell loop, as the Tiltfile defines it."""
    loop = evaluate().images["slipstream/learner"].args["entrypoint"][2]
    assert f"${{RESTART_FILE:-{RESTART_FILE}}}" in loop
    return str(loop)


def test_the_tiltfile_loads_no_extension() -> None:
    # Tilt fetches `ext://` extensions from the network: `tilt up -- --local` must work offline.
    assert "load(" not in TILTFILE.read_text()


def test_the_restart_loop_restarts_on_a_new_signal_passes_sigterm_and_keeps_exit_codes(tmp_path: Path) -> None:
    # The loop for real, under /bin/sh, around a child that writes its pid and sleeps.
    signal_file, pids = tmp_path / "restart", tmp_path / "pids"
    child = [
        sys.executable,
        "-c",
        f"import os, time; open({str(pids)!r}, 'a').write(f'{{os.getpid()}}\\n'); time.sleep(60)",
    ]
    env = {**os.environ, "RESTART_FILE": str(signal_file), "RESTART_POLL_S": "0.05"}
    proc = subprocess.Popen(["/bin/sh", "-c", restart_loop(), "restart-on-sync", *child], env=env)

    def started(n: int) -> list[str]:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            lines = pids.read_text().split() if pids.exists() else []
            if len(lines) >= n:
                return lines
            time.sleep(0.05)
        raise AssertionError(f"the child did not start {n} time(s): {pids.read_text() if pids.exists() else ''}")

    try:
        first = started(1)
        signal_file.write_text("1\n")
        second = started(2)
        assert second[0] == first[0] and second[1] != second[0]
        with pytest.raises(ProcessLookupError):
            os.kill(int(first[0]), 0)  # the first child was stopped
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) != 0  # the child died of the SIGTERM passed on
        with pytest.raises(ProcessLookupError):
            os.kill(int(second[1]), 0)
    finally:
        if proc.poll() is None:
            proc.kill()
    # A child that exits by itself ends the loop with its exit code.
    code = subprocess.run(["/bin/sh", "-c", restart_loop(), "restart-on-sync", "sh", "-c", "exit 7"], env=env)
    assert code.returncode == 7


def test_cluster_mode_deploys_the_dev_overlay_and_defines_every_resource() -> None:
    run = evaluate()
    (k,) = run.of("kustomize")
    assert k.args["pathToDir"] == "deploy/k8s/overlays/dev" and len(run.of("k8s_yaml")) == 1
    workloads = {"rollout-worker", "reward-model", "learner", "eval-gate", "task-source", "tool-service"}
    assert set(run.resources) == INFRA | workloads
    assert set(run.enabled) == INFRA | workloads | {"uncategorized"}
    rendered = {o["metadata"]["name"] for o in kl.build(REPO / k.args["pathToDir"])}
    assert set(run.resources) <= rendered, "a k8s_resource names a workload the overlay does not define"


def test_every_image_built_is_a_dockerfile_target_used_by_the_dev_overlay() -> None:
    targets = set(images.build_targets())
    manifests = {
        c["image"]
        for o in kl.build(REPO / "deploy/k8s/overlays/dev")
        for c in o.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])
        + o.get("spec", {}).get("template", {}).get("spec", {}).get("initContainers", [])
    }
    for flags, cuda in (((), False), (("--gpu",), True)):
        built = evaluate(*flags).images
        assert set(built) == {f"slipstream/{s}" for s in table.SERVICES} | {"slipstream/provision"}
        for ref, call in built.items():
            assert call.args["target"] in targets and call.args["dockerfile"] == "deploy/docker/Dockerfile"
            assert ref in manifests, f"{ref} is built but no dev manifest runs it"
        gpu_targets = {built[f"slipstream/{s}"].args["target"] for s in ("rollout-worker", "learner")}
        assert gpu_targets == ({"rollout-worker", "learner"} if cuda else {"rollout-worker-cpu", "learner-cpu"})


def test_live_update_syncs_libs_and_service_code_where_the_image_installs_them() -> None:
    for service in table.SERVICES:
        call = evaluate().images[f"slipstream/{service}"]
        assert call.name == "docker_build"
        shell, flag, loop, name, script = call.args["entrypoint"]
        assert (shell, flag, name, script) == ("/bin/sh", "-c", "restart-on-sync", table.console_script(service))
        assert loop == restart_loop()
        steps = call.args["live_update"]
        # Tilt's order rule: fall_back_on first; the restart signal last, after the code is synced.
        assert [s["__tilt__"] for s in steps] == ["fall_back_on", "sync", "sync", "run"]
        assert steps[-1]["cmd"] == f"date +%s%N > {RESTART_FILE}"
        syncs = {s["local_path"]: s["remote_path"] for s in steps if s["__tilt__"] == "sync"}
        src = f"services/{service}/src"
        assert syncs == {"libs": "/app/libs", src: f"/app/{src}"}
        # Whatever changes the installed venv rebuilds instead of syncing.
        rebuild = {str((REPO / f).resolve().relative_to(REPO)) for f in steps[0]["files"]}
        lib_pyprojects = {str(p.relative_to(REPO)) for p in REPO.glob("libs/*/pyproject.toml")}
        assert rebuild >= {"deploy/docker/Dockerfile", "tools/constraints.txt", f"services/{service}/pyproject.toml"}
        assert rebuild >= lib_pyprojects
        assert set(call.args["only"]) >= {"libs", f"services/{service}"}


def test_port_forwards_reach_the_services_http_ports_on_distinct_local_ports() -> None:
    forwards = {}
    for c in evaluate().of("k8s_resource"):
        for pf in c.args["port_forwards"] or []:
            forwards[pf["local_port"]] = (c.args["workload"], pf["container_port"], pf["name"])
    for service in table.SERVICES:
        hits = [(w, port) for w, port, name in forwards.values() if name.startswith(service + " ")]
        assert len(hits) == 1, f"{service}: {hits}"
        assert hits[0][1] == toml_port(service)
    assert forwards[8103][0] == forwards[8104][0] == "learner"  # the publisher is the learner pod's sidecar


def test_services_flag_selects_workloads_and_keeps_infra() -> None:
    run = evaluate("--services", "learner,reward-model")
    assert set(run.enabled) == INFRA | {"uncategorized", "learner", "reward-model"}
    assert set(evaluate("--services", "task_source").enabled) == INFRA | {"uncategorized", "task-source"}
    assert set(evaluate("--services", "weight_publisher").enabled) == INFRA | {"uncategorized", "learner"}
    with pytest.raises(tilt.TiltfileError, match='unknown service "bogus"'):
        tilt.evaluate(TILTFILE, ["--services", "bogus"], environ={})
    with pytest.raises(tilt.TiltfileError, match="unknown flag --nope"):
        tilt.evaluate(TILTFILE, ["--nope"], environ={})


# ---------------------------------------------------------------- local mode


def test_local_mode_runs_each_service_as_a_process_against_the_embedded_stack() -> None:
    run = evaluate("--local")
    assert not run.of("docker_build") and not run.of("k8s_yaml")
    calls = {c.args["name"]: c.args for c in run.of("local_resource")}
    assert set(calls) == {"stack", *table.SERVICES}
    stack = calls.pop("stack")
    assert " up --services none " in stack["serve_cmd"] and "--run-dir .slipstream/tilt" in stack["serve_cmd"]
    assert stack["readiness_probe"]["exec"]["command"] == ["test", "-f", ".slipstream/tilt/stack.json"]
    ports = set()
    pods = []
    for service, args in calls.items():
        assert args["serve_cmd"].endswith(f" -m {table.package(service)}")
        assert "deploy/tilt/stack_env.py .slipstream/tilt/stack.json --" in args["serve_cmd"]
        assert args["resource_deps"] == ["stack"]
        env = args["serve_env"]
        probe = args["readiness_probe"]["http_get"]
        assert probe["path"] == "/readyz" and probe["port"] == int(env["SLIPSTREAM_SERVICE__HTTP_PORT"])
        ports.add(probe["port"])
        cls = table.config_class(service)
        # What the service resolves once deploy/tilt/stack_env.py has added the stack's URLs.
        env = stack_env.service_env({"nats": "nats://127.0.0.1:40001", "redis": "redis://127.0.0.1:40002/0"}, env)
        cfg = runtime_config.build(cls, runtime_config.env_layer(cls, env))
        assert cfg.service.http_host == "127.0.0.1" and cfg.service.run_id == "tilt"  # type: ignore[attr-defined]
        assert getattr(cfg, "store", None) is None or cfg.store.type == "local"  # type: ignore[attr-defined]
        assert set(args["deps"]) == {"libs", f"services/{service}/src"}
        pods.append(podcfg.PodConfig(f"local_resource/{service}", service, service, cfg))
    assert len(ports) == len(calls)
    staging = calls["learner"]["serve_env"]["SLIPSTREAM_LEARNER__STAGING_DIR"]
    assert calls["weight-publisher"]["serve_env"]["SLIPSTREAM_PUBLISHER__STAGING_DIR"] == staging
    # One run: the task source paces for the learner, the workers sample at its temperature.
    assert podcfg.mismatches(pods) == []
    assert pods[0].config.service.redis_url == "redis://127.0.0.1:40002/0"


def test_local_mode_honours_services_and_python_override() -> None:
    run = tilt.evaluate(TILTFILE, ["--local", "--services", "eval-gate"], environ={"SLIPSTREAM_PYTHON": "/opt/py"})
    names = [c.args["name"] for c in run.of("local_resource")]
    assert names == ["stack", "eval-gate"]
    assert run.of("local_resource")[1].args["serve_cmd"].startswith("exec /opt/py deploy/tilt/stack_env.py")


def test_local_mode_runs_a_two_rank_learner_with_a_publisher_per_rank() -> None:
    run = evaluate("--local", "--learner-ranks", "2")
    calls = {c.args["name"]: c.args for c in run.of("local_resource")}
    assert set(calls) == {"stack", *table.SERVICES, "weight-publisher-1"}
    pods = []
    for name in ("learner", "weight-publisher", "weight-publisher-1"):
        service = name.removesuffix("-1")
        args = calls[name]
        assert args["serve_cmd"].endswith(f" -m {table.package(service)}")
        env = stack_env.service_env(
            {"nats": "nats://127.0.0.1:40001", "redis": "redis://127.0.0.1:40002/0"}, args["serve_env"]
        )
        cls = table.config_class(service)
        cfg = runtime_config.build(cls, runtime_config.env_layer(cls, env))
        assert args["readiness_probe"]["http_get"]["port"] == cfg.service.http_port  # type: ignore[attr-defined]
        pods.append(cfg)
    learner, pub0, pub1 = pods
    assert learner.learner.ranks == 2  # type: ignore[attr-defined]
    assert (pub0.publisher.rank, pub0.publisher.ranks) == (0, 2)  # type: ignore[attr-defined]
    assert (pub1.publisher.rank, pub1.publisher.ranks) == (1, 2)  # type: ignore[attr-defined]
    # Both publishers watch the learner's staging directory (rank r's part in its rank-<r> folder).
    assert pub0.publisher.staging_dir == pub1.publisher.staging_dir == learner.learner.staging_dir  # type: ignore[attr-defined]
    ports = [c["readiness_probe"]["http_get"]["port"] for c in calls.values() if c["name"] != "stack"]
    assert len(set(ports)) == len(ports)


@pytest.mark.parametrize(
    ("args", "error"),
    [
        (("--local", "--learner-ranks", "two"), "--learner-ranks must be a whole number >= 1"),
        (("--local", "--learner-ranks", "0"), "--learner-ranks must be a whole number >= 1"),
        (("--learner-ranks", "2"), "--learner-ranks needs --local"),
    ],
)
def test_learner_ranks_is_checked(args: tuple[str, ...], error: str) -> None:
    with pytest.raises(Exception, match=error):
        tilt.evaluate(TILTFILE, args, environ={})


# ---------------------------------------------------------------- both modes


@pytest.mark.parametrize("args", [(), ("--gpu",), ("--local",)], ids=["cluster", "cluster-gpu", "local"])
def test_every_path_the_tiltfile_names_exists_and_resources_carry_one_role(args: tuple[str, ...]) -> None:
    run = evaluate(*args)
    paths = named_paths(run)
    assert len(paths) >= 5
    missing = sorted(p for p in paths if not (REPO / p).exists())
    assert not missing, f"Tiltfile names paths that do not exist: {missing}"
    for c in run.of("k8s_resource") + run.of("local_resource"):
        labels = c.args["labels"]
        assert len(labels) == 1 and labels[0] in ROLES, (c.args, labels)


# ---------------------------------------------------------------- deploy/tilt/stack_env.py


def test_stack_env_maps_the_stack_urls_onto_config_variables() -> None:
    doc = {"servers": {"nats": {"url": "nats://127.0.0.1:40123", "pid": 7}, "redis": "redis://127.0.0.1:40124/0"}}
    env = stack_env.service_env(doc, {"PATH": "/bin", "SLIPSTREAM_SERVICE__REDIS_URL": "redis://mine:1/0"})
    assert env["SLIPSTREAM_BUS__URL"] == "nats://127.0.0.1:40123"
    assert env["SLIPSTREAM_SERVICE__REDIS_URL"] == "redis://mine:1/0"  # already set: the developer's value wins
    assert env["PATH"] == "/bin"
    assert stack_env.stack_urls({"nats_url": "nats://h:1"}) == {"SLIPSTREAM_BUS__URL": "nats://h:1"}


def test_stack_env_passes_the_runs_signing_key_and_its_trusted_public_key() -> None:
    doc = {
        "servers": {"nats": {"url": "nats://127.0.0.1:40123"}},
        "trust": {"signing_key": "/run/data/keys/weights-signing.pem", "trusted_keys": ["ed25519:AAAA"]},
    }
    env = stack_env.service_env(doc, {})
    assert env["SLIPSTREAM_TRUST__SIGNING_KEY"] == "/run/data/keys/weights-signing.pem"
    assert json.loads(env["SLIPSTREAM_TRUST__TRUSTED_KEYS"]) == ["ed25519:AAAA"]
    assert "SLIPSTREAM_TRUST__SIGNING_KEY" not in stack_env.service_env({"nats": "nats://h:1"}, {})


def test_stack_env_gives_a_service_its_own_users_from_the_stacks_credentials(tmp_path: Path) -> None:
    creds = tmp_path / "credentials.json"
    creds.write_text(json.dumps({"nats": {"reward-model": "n-pw"}, "redis": {"reward-model": "r-pw"}}))
    doc = {
        "servers": {"nats": {"url": "nats://127.0.0.1:40123"}, "redis": {"url": "redis://127.0.0.1:40124/0"}},
        "credentials_file": str(creds),
    }
    service = stack_env.service_of(["python", "-m", "slipstream.reward_model"])
    assert service == "reward-model"
    env = stack_env.service_env(doc, {}, service)
    assert (env["SLIPSTREAM_BUS__USER"], env["SLIPSTREAM_BUS__PASSWORD"]) == ("reward-model", "n-pw")
    assert env["SLIPSTREAM_SERVICE__REDIS_URL"] == "redis://reward-model:r-pw@127.0.0.1:40124/0"
    with pytest.raises(stack_env.StackFileError, match="no NATS user 'learner'"):
        stack_env.service_env(doc, {}, "learner")
    assert "SLIPSTREAM_BUS__USER" not in stack_env.service_env({"nats": "nats://h:1"}, {}, "learner")


@pytest.mark.parametrize(
    ("doc", "error"),
    [
        ({"redis": "redis://h:1"}, "no nats:// URL"),
        ({"a": "nats://h:1", "b": ["nats://h:2"]}, "several nats:// URLs"),
    ],
)
def test_stack_env_rejects_a_stack_file_without_exactly_one_nats(doc: dict[str, Any], error: str) -> None:
    with pytest.raises(stack_env.StackFileError, match=error):
        stack_env.stack_urls(doc)


def test_stack_env_waits_for_the_file_and_reports_a_timeout(tmp_path: Path) -> None:
    path = tmp_path / "stack.json"
    with pytest.raises(stack_env.StackFileError, match="does not exist"):
        stack_env.wait_for(path, timeout_s=0.1)
    path.write_text('{"nats": "nats://127.0.0.1:4')
    with pytest.raises(stack_env.StackFileError, match="not complete JSON"):
        stack_env.wait_for(path, timeout_s=0.1)
    path.write_text('{"state": "stopped", "nats": "nats://127.0.0.1:4222"}')
    with pytest.raises(stack_env.StackFileError, match="is stopped"):
        stack_env.wait_for(path, timeout_s=0.1)
    path.write_text('{"nats": "nats://127.0.0.1:4222"}')
    assert stack_env.wait_for(path, timeout_s=0.1) == {"nats": "nats://127.0.0.1:4222"}
