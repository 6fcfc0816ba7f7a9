"""Offline checks that the deploy configs agree with the code and with each other.

Probes, ports and grace periods of every service container are compared with the TOML it
mounts; every TOML and env file under deploy/ is parsed into its service's config class; the
containers of one overlay must resolve to one consistent run (deploy/tools/pod_config.py), and
the checker is shown to name each kind of disagreement.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from deploy_helpers import DEPLOY, find, mounted_toml, pod_specs, podcfg, render, service_containers, table

from slipstream.runtime import config as runtime_config

pytestmark = pytest.mark.unit


# ---------------------------------------------------------------- probes, config files


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_probes_ports_and_grace_match_the_service_toml(overlay: str) -> None:
    objs = render(overlay)
    checked = 0
    for owner, spec in pod_specs(objs):
        for c in service_containers(spec):
            cfg = mounted_toml(objs, spec, c)
            port = cfg["service"]["http_port"]
            assert cfg["service"]["http_host"] == "0.0.0.0", f"{owner}/{c['name']} binds loopback only"
            named = {p["name"]: p["containerPort"] for p in c["ports"]}
            assert port in named.values(), f"{owner}/{c['name']} exposes {named}, TOML says {port}"
            # Liveness must not depend on NATS or S3: only /healthz, never /readyz.
            for probe, path in (
                ("livenessProbe", "/healthz"),
                ("readinessProbe", "/readyz"),
                ("startupProbe", "/healthz"),
            ):
                get = c[probe]["httpGet"]
                assert get["path"] == path, f"{owner}/{c['name']} {probe} hits {get['path']}"
                assert named.get(get["port"], get["port"]) == port
            assert spec["terminationGracePeriodSeconds"] > cfg["service"]["drain_timeout_s"], owner
            checked += 1
    assert checked >= {"dev": 6, "prod": 6, "prod/learner-ray": 1}[overlay]


def test_every_deploy_toml_parses_into_its_service_config() -> None:
    files = sorted(DEPLOY.rglob("*.toml"))
    assert len(files) >= 7
    for path in files:
        service = path.stem
        assert service in table.SERVICES, f"{path}: config files are named <service>.toml"
        runtime_config.resolve(table.config_class(service), config_file=path, environ={})


@pytest.mark.parametrize("env_file", sorted(DEPLOY.rglob("slipstream.env")), ids=lambda p: str(p.relative_to(DEPLOY)))
def test_env_files_only_set_known_config_fields(env_file: Path) -> None:
    env = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if line and not line.startswith("#"))
    assert all(k.startswith(("SLIPSTREAM_", "OTEL_")) for k in env), sorted(env)
    assert not any(re.search("SECRET|PASSWORD|TOKEN|ACCESS_KEY", k) for k in env), "credentials belong in a Secret"
    for service in table.SERVICES:
        tree = runtime_config.env_layer(table.config_class(service), env)
        runtime_config.build(table.config_class(service), tree)
    assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector:4318"


# ---------------------------------------------------------------- one run: the services' configs agree


def _pods(overlay: str) -> list[Any]:
    # A per-service prod overlay is applied after prod/common (namespace, slipstream-env).
    extra = render("prod/common") if overlay.startswith("prod/") else []
    return podcfg.resolve(render(overlay) + extra)


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_the_services_of_an_overlay_resolve_to_one_consistent_run(overlay: str) -> None:
    pods = _pods(overlay)
    services = sorted({p.service for p in pods})
    expected = ["learner", "weight-publisher"] if overlay == "prod/learner-ray" else sorted(table.SERVICES)
    assert services == expected
    assert podcfg.mismatches(pods) == []
    if overlay != "prod/learner-ray":
        # The sub-agent pool runs the rollout-worker service too; `by` holds the task workers.
        by = {p.service: p.config for p in pods if not _is_pool(p)}
        # The shared endpoints come from slipstream-env and the Secret, not from six TOML files.
        assert {p.get("service", "run_id") for p in pods} == {overlay}
        assert by["learner"].service.redis_url and by["learner"].learner.staging_dir.startswith("/var/run/")
        # Workers read the fencing tokens the lease granted (announce checks); the reward-model needs no Redis.
        assert by["rollout-worker"].service.redis_url
        assert by["reward-model"].service.redis_url == ""


def test_the_ray_learner_runs_the_same_run_as_the_single_gpu_learner() -> None:
    single = {(p.service, p.owner): p.config for p in _pods("prod/learner")}
    ray = {(p.service, p.owner): p.config for p in _pods("prod/learner-ray")}
    driver = ray[("learner", "RayJob/learner")]
    # Only the Ray keys differ: N ranks on the RayJob's own cluster instead of one in-process trainer.
    assert (driver.learner.ranks, driver.learner.ray_address) == (4, "auto")
    ray_keys = {
        "ranks": 1,
        "ray_address": "",
        "rank_start_timeout_s": single[("learner", "Deployment/learner")].learner.rank_start_timeout_s,
        "rank_resource": "",
        "shared_dir": "",
    }
    as_single = msgspec.structs.replace(driver, learner=msgspec.structs.replace(driver.learner, **ray_keys))
    assert single[("learner", "Deployment/learner")] == as_single
    # One publisher per rank; apart from its rank and the rank count, each is the single learner's publisher.
    publishers = [p.config for p in _pods("prod/learner-ray") if p.service == "weight-publisher"]
    assert sorted(p.publisher.rank for p in publishers) == list(range(driver.learner.ranks))  # type: ignore[attr-defined]
    for cfg in publishers:
        section = cfg.publisher  # type: ignore[attr-defined]
        assert section.ranks == driver.learner.ranks
        whole = msgspec.structs.replace(cfg, publisher=msgspec.structs.replace(section, rank=0, ranks=1))
        assert single[("weight-publisher", "Deployment/learner")] == whole


@pytest.mark.parametrize(
    ("service", "section", "field", "value", "expected"),
    [
        ("task-source", "tasks", "groups_per_step", 3, "tasks.groups_per_step=3 but Deployment/learner"),
        ("task-source", "tasks", "learner_checkpoint_every", 1, "tasks.learner_checkpoint_every=1"),
        ("rollout-worker", "worker", "temperature", 0.7, "worker.temperature=0.7 but"),
        ("eval-gate", "model", "seed", 5, "model (path, preset, seed) differs"),
        ("reward-model", "reward", "env_options", {"arith": {"max_operand": 9}}, "env_options['arith'] differs"),
        ("weight-publisher", "service", "redis_url", "", "service.redis_url is empty"),
        ("learner", "service", "run_id", "other", "service.run_id differs"),
        ("learner", "learner", "lease_handover_s", 200.0, "lease_handover_s must fit"),
        (
            "learner",
            "learner",
            "ranks",
            2,
            "learner.ranks=2 needs one publisher per rank, found (rank, ranks) [(0, 1)]",
        ),
    ],
)
def test_the_consistency_check_names_each_kind_of_disagreement(
    service: str, section: str, field: str, value: Any, expected: str
) -> None:
    # Guards the guard: with a blind checker the test above would pass vacuously.
    pods = _pods("prod")
    i = next(i for i, p in enumerate(pods) if p.service == service)
    cfg = pods[i].config
    changed = msgspec.structs.replace(
        cfg, **{section: msgspec.structs.replace(getattr(cfg, section), **{field: value})}
    )
    pods[i] = podcfg.PodConfig(pods[i].owner, pods[i].container, service, changed)
    found = podcfg.mismatches(pods)
    assert len(found) == 1 and expected in found[0], found


@pytest.mark.parametrize(("rank", "ranks"), [(0, 4), (2, 3)])
def test_the_consistency_check_names_a_missing_rank_publisher(rank: int, ranks: int) -> None:
    # Rank 3's publisher made a second rank 0 (no one stores part 3), or told of 3 ranks instead of 4.
    pods = _pods("prod/learner-ray")
    i = next(i for i, p in enumerate(pods) if p.service == "weight-publisher" and p.get("publisher", "rank") == 3)
    cfg = pods[i].config
    section = msgspec.structs.replace(cfg.publisher, rank=rank, ranks=ranks)  # type: ignore[attr-defined]
    pods[i] = podcfg.PodConfig(
        pods[i].owner, pods[i].container, "weight-publisher", msgspec.structs.replace(cfg, publisher=section)
    )
    found = podcfg.mismatches(pods)
    assert len(found) == 1 and "learner.ranks=4 needs one publisher per rank" in found[0], found


def test_rollout_worker_keda_target_is_the_tasks_one_replica_holds() -> None:
    objs = render("prod")
    (worker,) = [p for p in podcfg.resolve(objs) if p.service == "rollout-worker" and not _is_pool(p)]
    meta = find(objs, "ScaledObject", "rollout-worker")["spec"]["triggers"][0]["metadata"]
    assert int(meta["lagThreshold"]) == worker.get("worker", "max_tasks_in_flight")


def test_subagent_pool_is_a_pinned_rollout_worker_scaled_on_the_requests_one_replica_plays() -> None:
    objs = render("prod")
    (pool,) = [p for p in podcfg.resolve(objs) if _is_pool(p)]
    assert pool.service == "rollout-worker" and pool.owner == "Deployment/subagent-pool"
    assert pool.get("pool", "pin_version") >= 0
    meta = find(objs, "ScaledObject", "subagent-pool")["spec"]["triggers"][0]["metadata"]
    assert (meta["stream"], meta["consumer"]) == ("SUBAGENTS", "subagent-pool")
    assert int(meta["lagThreshold"]) == pool.get("pool", "max_in_flight")


def _is_pool(p: podcfg.PodConfig) -> bool:
    return p.service == "rollout-worker" and bool(p.get("pool", "subagents"))
