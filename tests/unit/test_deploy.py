"""Offline checks of deploy/: images, Kustomize overlays, KEDA, KubeRay, NATS Helm values, OTel.

Every overlay is rendered with deploy/tools/kustomize_lite.py (kustomize is not installable
here) and every object validated strictly against the Kubernetes 1.33 schemas bundled with
kubernetes-validate; custom resources against the CRDs in deploy/crds, their pod templates as
core/v1 PodTemplateSpecs. The manifests are then compared with the code: KEDA triggers with the
subject table, probes and grace periods with the services' TOML, images with the Dockerfile,
the Dockerfile with the packages' dependencies.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
import tomllib
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate
import msgspec
import pytest
import yaml

from slipstream.runtime import config as runtime_config
from slipstream.schemas import subjects

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
K8S_VERSION = "1.33"
UID = 10001


def _tool(name: str) -> ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, DEPLOY / "tools" / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


kl = _tool("kustomize_lite")
crdv = _tool("crd_validation")
table = _tool("service_table")
images = _tool("image_stages")
podcfg = _tool("pod_config")

OVERLAYS = sorted(
    str(p.parent.relative_to(DEPLOY / "k8s" / "overlays")) for p in DEPLOY.glob("k8s/overlays/**/kustomization.yaml")
)


@cache
def render(overlay: str) -> list[dict[str, Any]]:
    return kl.build(DEPLOY / "k8s" / "overlays" / overlay)


@cache
def crds() -> Any:
    return crdv.CrdRegistry(DEPLOY / "crds")


def find(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert len(hits) == 1, f"expected one {kind} {name}, found {len(hits)}"
    return hits[0]


def pod_specs(objs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(owner, pod spec) for every workload and every pod template inside custom resources."""
    out = []
    for o in objs:
        tpl = o.get("spec", {}).get("template") if o["kind"] in ("Deployment", "StatefulSet", "Job") else None
        if tpl:
            out.append((f"{o['kind']}/{o['metadata']['name']}", tpl["spec"]))
        if crds().covers(o):
            out += [(f"{o['kind']}/{o['metadata']['name']}:{p}", t["spec"]) for p, t in crdv.pod_templates(o)]
    return out


def service_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    """Containers running a service's long-lived process (they take --config)."""
    return [c for c in spec.get("containers", []) + spec.get("initContainers", []) if "--config" in c.get("args", [])]


def mounted_toml(objs: list[dict[str, Any]], spec: dict[str, Any], container: dict[str, Any]) -> dict[str, Any]:
    """The TOML a container reads: --config path -> volume mount -> ConfigMap -> parsed file."""
    path = container["args"][container["args"].index("--config") + 1]
    mount = next(m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    cm = find(objs, "ConfigMap", volume["configMap"]["name"])
    return tomllib.loads(cm["data"][path[len(mount["mountPath"]) + 1 :]])


# ---------------------------------------------------------------- schema validation

_UNIQUE: dict[str, tuple[str, dict[str, Any]]] = {}
for _overlay in OVERLAYS:
    for _obj in render(_overlay):
        _UNIQUE.setdefault(repr(_obj), (f"{_overlay}:{_obj['kind']}/{_obj['metadata']['name']}", _obj))


@pytest.mark.parametrize("obj", [o for _, o in _UNIQUE.values()], ids=[i for i, _ in _UNIQUE.values()])
def test_every_rendered_object_validates_strictly(obj: dict[str, Any]) -> None:
    if crds().covers(obj):
        crds().validate(obj)
        templates = list(crdv.pod_templates(obj))
        assert templates or obj["kind"] == "ScaledObject", f"{obj['kind']} has no pod template to check"
        for path, tpl in templates:
            kubernetes_validate.validate(
                crdv.as_pod_template(tpl, path.replace("/", "-").lower()), K8S_VERSION, strict=True
            )
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_overlays_cover_dev_prod_and_every_prod_service() -> None:
    assert {"dev", "prod", "prod/common", "prod/learner-ray"} <= set(OVERLAYS)
    assert {f"prod/{s}" for s in ("rollout-worker", "reward-model", "learner", "eval-gate", "task-source")} <= set(
        OVERLAYS
    )


def test_shipped_crds_are_valid_crds_and_strict() -> None:
    assert {k for _, k in crds().schemas} == {"ScaledObject", "RayJob", "RayCluster"}
    for crd in crds().crds:
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    scaled = find(render("prod"), "ScaledObject", "reward-model")
    bad = {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}
    with pytest.raises(crdv.CustomResourceError, match="minReplicas"):
        crds().validate(bad)


def test_references_resolve_inside_each_full_overlay() -> None:
    external = {"prod": {("Secret", "slipstream-credentials")}, "dev": set()}
    for overlay, allowed in external.items():
        objs = render(overlay)
        names = {(o["kind"], o["metadata"]["name"]) for o in objs}
        for owner, spec in pod_specs(objs):
            refs = _refs(spec)
            missing = {r for r in refs if r not in names and r not in allowed}
            assert not missing, f"{overlay} {owner} references missing {sorted(missing)}"


def _refs(node: Any) -> set[tuple[str, str]]:
    out: set[tuple[str, str]] = set()
    if isinstance(node, dict):
        for field, kind, key in (
            ("configMap", "ConfigMap", "name"),
            ("configMapRef", "ConfigMap", "name"),
            ("configMapKeyRef", "ConfigMap", "name"),
            ("secretRef", "Secret", "name"),
            ("secretKeyRef", "Secret", "name"),
        ):
            if isinstance(node.get(field), dict):
                out.add((kind, node[field][key]))
        for v in node.values():
            out |= _refs(v)
    elif isinstance(node, list):
        for v in node:
            out |= _refs(v)
    return out


# ---------------------------------------------------------------- probes, config, security


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


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_pods_run_as_non_root_and_take_credentials_from_secrets(overlay: str) -> None:
    for owner, spec in pod_specs(render(overlay)):
        assert spec["securityContext"]["runAsNonRoot"] is True, owner
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False, f"{owner}/{c['name']}"
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "cpu" in c["resources"]["requests"] and "memory" in c["resources"]["limits"], c["name"]
            for e in c.get("env", []):
                if re.search("KEY|SECRET|PASSWORD|TOKEN|REDIS_URL|ROOT_USER", e["name"]):
                    assert "secretKeyRef" in e.get("valueFrom", {}), (
                        f"{owner}/{c['name']}: {e['name']} not from a Secret"
                    )
        if "slipstream/" in str(spec["containers"][0]["image"]):
            assert spec["securityContext"]["runAsUser"] == UID, owner


def test_learner_pod_has_its_publisher_as_a_sidecar_sharing_memory() -> None:
    for overlay in ("dev", "prod"):
        objs = render(overlay)
        spec = find(objs, "Deployment", "learner")["spec"]["template"]["spec"]
        _assert_publisher_sidecar(objs, spec, "learner", learner_toml=mounted_toml(objs, spec, spec["containers"][0]))
    objs = render("prod/learner-ray")
    cluster = find(objs, "RayJob", "learner")["spec"]["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    driver_toml = tomllib.loads(
        find(objs, "ConfigMap", head["volumes"][0]["configMap"]["name"])["data"]["learner.toml"]
    )
    worker = cluster["workerGroupSpecs"][0]["template"]["spec"]
    _assert_publisher_sidecar(objs, worker, "ray-worker", learner_toml=driver_toml)


def _assert_publisher_sidecar(objs: list[Any], spec: dict[str, Any], main: str, learner_toml: dict[str, Any]) -> None:
    sidecar = next(c for c in spec["initContainers"] if c["name"] == "weight-publisher")
    assert sidecar["restartPolicy"] == "Always"  # native sidecar: up before, down after the main container
    learner = next(c for c in spec["containers"] if c["name"] == main)
    memory = {v["name"] for v in spec["volumes"] if v.get("emptyDir", {}).get("medium") == "Memory"}
    shared = {(m["name"], m["mountPath"]) for m in sidecar["volumeMounts"]} & {
        (m["name"], m["mountPath"]) for m in learner["volumeMounts"]
    }
    paths = {path for name, path in shared if name in memory}
    assert len(paths) == 1, f"no single in-memory volume shared by {main} and weight-publisher: {shared}"
    staging = learner_toml["learner"]["staging_dir"]
    assert staging in paths and mounted_toml(objs, spec, sidecar)["publisher"]["staging_dir"] == staging


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
        by = {p.service: p.config for p in pods}
        # The shared endpoints come from slipstream-env and the Secret, not from six TOML files.
        assert {p.get("service", "run_id") for p in pods} == {overlay}
        assert by["learner"].service.redis_url and by["learner"].learner.staging_dir.startswith("/var/run/")
        assert by["rollout-worker"].service.redis_url == by["reward-model"].service.redis_url == ""


def test_the_ray_learner_runs_the_same_run_as_the_single_gpu_learner() -> None:
    single = {(p.service, p.owner): p.config for p in _pods("prod/learner")}
    ray = {(p.service, p.owner): p.config for p in _pods("prod/learner-ray")}
    assert single[("learner", "Deployment/learner")] == ray[("learner", "RayJob/learner")]
    assert single[("weight-publisher", "Deployment/learner")] == ray[("weight-publisher", "RayJob/learner")]


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


def test_rollout_worker_keda_target_is_the_tasks_one_replica_holds() -> None:
    objs = render("prod")
    (worker,) = [p for p in podcfg.resolve(objs) if p.service == "rollout-worker"]
    meta = find(objs, "ScaledObject", "rollout-worker")["spec"]["triggers"][0]["metadata"]
    assert int(meta["lagThreshold"]) == worker.get("worker", "max_tasks_in_flight")


# ---------------------------------------------------------------- prod: GPUs, PDBs, KEDA


def test_prod_gpu_services_request_gpus_in_limits_on_gpu_nodes() -> None:
    objs = render("prod")
    for name in ("rollout-worker", "learner"):
        spec = find(objs, "Deployment", name)["spec"]["template"]["spec"]
        c = next(c for c in spec["containers"] if c["name"] == name)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert c["resources"]["requests"].get("nvidia.com/gpu", 1) == c["resources"]["limits"]["nvidia.com/gpu"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    for name in ("reward-model", "eval-gate", "task-source"):
        c = find(objs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})


def test_prod_has_a_pdb_selecting_every_service_deployment() -> None:
    objs = render("prod")
    for d in (o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"] != "otel-collector"):
        labels = d["spec"]["template"]["metadata"]["labels"]
        pdbs = [
            p
            for p in objs
            if p["kind"] == "PodDisruptionBudget" and p["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ]
        assert len(pdbs) == 1, f"Deployment {d['metadata']['name']} has {len(pdbs)} PDBs"


def test_keda_scales_each_horizontal_service_on_its_own_jetstream_consumer() -> None:
    objs = render("prod")
    helm = yaml.safe_load((DEPLOY / "helm" / "nats" / "values.yaml").read_text())
    scaled = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ScaledObject"}
    assert set(scaled) == {"rollout-worker", "reward-model", "eval-gate"}
    for name, so in scaled.items():
        target = find(objs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
        assert "replicas" not in target["spec"], f"{name}: a fixed replica count would fight KEDA's HPA"
        (trigger,) = so["spec"]["triggers"]
        meta = trigger["metadata"]
        assert trigger["type"] == "nats-jetstream"
        stream, consumer = subjects.consumer(meta["consumer"])
        assert meta["stream"] == stream.name and consumer.service == target["metadata"]["name"]
        host, port = meta["natsServerMonitoringEndpoint"].rsplit(":", 1)
        assert int(port) == helm["config"]["monitor"]["port"] and host == "nats.nats.svc.cluster.local"
        assert int(meta["lagThreshold"]) >= 1
    # Floors of one where a cold start costs minutes (GPU model load, policy load for evals).
    assert scaled["rollout-worker"]["spec"]["minReplicaCount"] == 1
    assert scaled["eval-gate"]["spec"]["minReplicaCount"] == 1
    assert find(objs, "Deployment", "learner")["spec"]["replicas"] == 1


@pytest.mark.parametrize("overlay", ["dev", "prod"])
def test_learner_and_task_source_run_exactly_one_replica_never_two_at_once(overlay: str) -> None:
    # A second learner is fenced by the lease; a second task source would open the pacing window twice.
    objs = render(overlay)
    for name in ("learner", "task-source"):
        spec = find(objs, "Deployment", name)["spec"]
        assert spec["replicas"] == 1 and spec["strategy"]["type"] == "Recreate", name
    assert not [o for o in objs if o["kind"] == "ScaledObject" and o["spec"]["scaleTargetRef"]["name"] == "task-source"]


def test_nats_helm_values_give_a_persistent_jetstream_cluster_matching_prod_config() -> None:
    values = yaml.safe_load((DEPLOY / "helm" / "nats" / "values.yaml").read_text())
    chart_keys = {
        "config",
        "container",
        "reloader",
        "promExporter",
        "service",
        "statefulSet",
        "podTemplate",
        "headlessService",
        "natsBox",
        "podDisruptionBudget",
        "serviceAccount",
        "global",
    }
    assert set(values) <= chart_keys, set(values) - chart_keys
    assert values["config"]["jetstream"]["enabled"] and values["config"]["jetstream"]["fileStore"]["pvc"]["enabled"]
    replicas = values["config"]["cluster"]["replicas"]
    env = dict(
        line.split("=", 1) for line in (DEPLOY / "k8s/overlays/prod/common/slipstream.env").read_text().splitlines()
    )
    assert replicas >= 3 and 1 <= int(env["SLIPSTREAM_BUS__STREAM_REPLICAS"]) <= replicas
    assert env["SLIPSTREAM_BUS__URL"] == "nats://nats.nats.svc.cluster.local:4222"
    assert values["service"]["ports"]["monitor"]["enabled"] is True


def test_provision_job_runs_the_bus_provisioning_image_with_cluster_endpoints() -> None:
    for overlay in ("dev", "prod"):
        job = find(render(overlay), "Job", "provision-streams")
        (c,) = job["spec"]["template"]["spec"]["containers"]
        assert re.search(r"(^|/)slipstream/provision(:|$)", c["image"])
        assert any(e["configMapRef"]["name"].startswith("slipstream-env") for e in c["envFrom"])
        assert job["spec"]["backoffLimit"] >= 3


def test_otel_collector_pipelines_reference_defined_components() -> None:
    for path in DEPLOY.rglob("otel-collector.yaml"):
        cfg = yaml.safe_load(path.read_text())
        assert cfg["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
        for pipeline in cfg["service"]["pipelines"].values():
            for section in ("receivers", "processors", "exporters"):
                assert set(pipeline[section]) <= set(cfg[section]), f"{path}: {section} {pipeline[section]}"
        assert set(cfg["service"]["extensions"]) <= set(cfg["extensions"])
    svc = find(render("dev"), "Service", "otel-collector")
    assert 4318 in [p["port"] for p in svc["spec"]["ports"]]


# ---------------------------------------------------------------- images


def test_build_script_lists_exactly_the_final_targets_and_they_run_non_root() -> None:
    stages = images.stages()
    finals = {n for n, s in stages.items() if s.entrypoint}
    assert set(images.build_targets()) == finals
    for name in finals:
        assert stages[name].user == f"{UID}:{UID}", name
        cuda = "CUDA_IMAGE" in images.root_base(stages, name)
        assert cuda == (name in {"rollout-worker", "learner", "learner-ray"}), name


@pytest.mark.parametrize("service", table.SERVICES)
def test_each_service_image_installs_exactly_its_libs_and_its_entry_point_exists(service: str) -> None:
    stages = images.stages()
    copied = images.copied_sources(stages, f"{service}-src")
    assert all((REPO / c).is_dir() for c in copied)
    assert copied == table.dependency_dirs(f"slipstream-{service}"), "libs copied != slipstream-* dependency closure"
    for target in (service, f"{service}-cpu"):
        if target in stages:
            assert stages[target].entrypoint == [table.console_script(service)], target
            assert (f"{service}-src", "/app/") in [(f, s) for f, s in stages[f"{target}-build"].copies]
    # The image's own health check asks /healthz on the port the deploy configs give the service.
    port = tomllib.loads(next((DEPLOY / "k8s/base").rglob(f"{service}.toml")).read_text())["service"]["http_port"]
    assert stages[service].expose[0] == port and f"http://127.0.0.1:{port}/healthz" in stages[service].healthcheck[-1]
    pyproject = tomllib.loads((REPO / "services" / service / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"][table.console_script(service)] == f"{table.package(service)}.__main__:main"
    main = table.source_dir(service) / "__main__.py"
    assert main.is_file(), f"{main} missing: the image's entry point has nothing to run"
    assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in ast.parse(main.read_text()).body)


def test_provision_image_entry_point_exists() -> None:
    stages = images.stages()
    assert stages["provision"].entrypoint == ["python", "-m", "slipstream.bus.provision"]
    # provision.py parses its config with slipstream.runtime.config, which slipstream-bus does not
    # declare: the image copies the runtime's closure too.
    wanted = table.dependency_dirs("slipstream-bus") | table.dependency_dirs("slipstream-runtime")
    assert images.copied_sources(stages, "provision-src") == wanted
    assert (REPO / "libs/bus/src/slipstream/bus/provision.py").is_file()


@pytest.mark.parametrize("stage", sorted(n for n in images.stages() if n.endswith("-src")))
def test_every_image_copies_the_libs_its_code_imports(stage: str) -> None:
    # The pyprojects can under-declare (provision.py above); what the code imports is what runs.
    where = images.package_dirs()
    copied = images.copied_sources(images.stages(), stage)
    missing = {
        f"{f.relative_to(REPO)} imports slipstream.{pkg}"
        for c in copied
        for f in (REPO / c / "src").rglob("*.py")
        for pkg in images.runtime_imports(f.read_text())
        if pkg in where and where[pkg] not in copied
    }
    assert not missing, sorted(missing)
    assert images.runtime_imports("from slipstream.store import x\nif TYPE_CHECKING:\n    import slipstream.cli") == {
        "store"
    }


def test_cpu_images_take_torch_2_13_0_from_the_cpu_wheel_index() -> None:
    assert "torch==2.13.0" in (REPO / "tools/constraints.txt").read_text().split()
    text = images.DOCKERFILE.read_text()
    assert re.search(r"^ARG TORCH_CPU_INDEX=https://download\.pytorch\.org/whl/cpu$", text, re.M)
    cpu_builder = text.split(" AS cpu-builder\n", 1)[1].split("\nFROM ", 1)[0]
    assert "PIP_EXTRA_INDEX_URL=${TORCH_CPU_INDEX}" in cpu_builder
    assert "-c /opt/slipstream/constraints.txt" in (DEPLOY / "docker/install-app.sh").read_text()
    stages = images.stages()
    torch_images = set()
    for target in images.build_targets():
        if "PYTHON_IMAGE" not in images.root_base(stages, target) or target == "provision":
            continue
        service = target.removesuffix("-cpu")
        pyprojects = [REPO / d / "pyproject.toml" for d in table.dependency_dirs(f"slipstream-{service}")]
        deps = [d for p in pyprojects for d in tomllib.loads(p.read_text())["project"].get("dependencies", [])]
        if any(re.match(r"torch\b", d) for d in deps):
            torch_images.add(target)
            assert images.builder(stages, f"{target}-build") == "cpu-builder", target
    # eval-gate runs the policy on its suite, so its CPU image carries torch.
    assert {"eval-gate", "rollout-worker-cpu", "learner-cpu", "weight-publisher"} <= torch_images
    assert "task-source" not in torch_images and "reward-model" not in torch_images


def test_dev_lets_tilt_sync_code_into_service_containers_and_prod_keeps_root_read_only() -> None:
    for overlay, writable in (("dev", True), ("prod", False)):
        checked = set()
        for owner, spec in pod_specs(render(overlay)):
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                if re.search(r"(^|/)slipstream/(?!provision)", c["image"]) and "--config" in c.get("args", []):
                    assert c["securityContext"]["readOnlyRootFilesystem"] is (not writable), f"{owner}/{c['name']}"
                    checked.add(c["name"])
        assert checked == set(table.SERVICES), (overlay, checked)


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_every_slipstream_image_in_the_manifests_is_a_dockerfile_target(overlay: str) -> None:
    targets = set(images.build_targets())
    used = set()
    for _, spec in pod_specs(render(overlay)):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            if m := re.search(r"(?:^|/)slipstream/([a-z-]+)", c["image"]):
                used.add(m[1])
    assert used and used <= targets, used - targets


# ---------------------------------------------------------------- the renderer itself


def _kustomization(root: Path, body: dict[str, Any], files: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "kustomization.yaml").write_text(yaml.safe_dump(body))
    for name, content in files.items():
        (root / name).write_text(content if isinstance(content, str) else yaml.safe_dump_all(content))
    return root


DEPLOYMENT = {
    "apiVersion": "apps/v1",
    "kind": "Deployment",
    "metadata": {"name": "w"},
    "spec": {
        "template": {
            "spec": {
                "containers": [
                    {"name": "a", "image": "slipstream/a", "env": [{"name": "X", "value": "1"}]},
                    {"name": "b", "image": "other/b:1.0"},
                ],
                "volumes": [{"name": "cfg", "configMap": {"name": "w-config"}}],
            }
        }
    },
}


def test_renderer_merges_patches_generates_hashed_configs_and_rewrites_references(tmp_path: Path) -> None:
    base = _kustomization(
        tmp_path / "base",
        {"resources": ["d.yaml"], "configMapGenerator": [{"name": "w-config", "files": ["w.toml"]}]},
        {"d.yaml": [DEPLOYMENT], "w.toml": "a = 1\n"},
    )
    patch = {
        "kind": "Deployment",
        "metadata": {"name": "w"},
        "spec": {"template": {"spec": {"containers": [{"name": "a", "env": [{"name": "Y", "value": "2"}]}]}}},
    }
    overlay = _kustomization(
        tmp_path / "overlay",
        {
            "resources": ["../base"],
            "namespace": "ns",
            "patches": [
                {"path": "p.yaml"},
                {
                    "target": {"kind": "Deployment", "name": "w"},
                    "patch": "- {op: replace, path: /spec/template/spec/containers/1/image, value: x}",
                },
            ],
            "images": [{"name": "slipstream/a", "newName": "reg.io/slipstream/a", "newTag": "7"}],
            "configMapGenerator": [{"name": "w-config", "behavior": "replace", "literals": ["w.toml=b = 2"]}],
        },
        {"p.yaml": [patch]},
    )
    objs = kl.build(overlay)
    dep, cm = find(objs, "Deployment", "w"), next(o for o in objs if o["kind"] == "ConfigMap")
    a, b = dep["spec"]["template"]["spec"]["containers"]
    assert [e["name"] for e in a["env"]] == ["X", "Y"] and a["image"] == "reg.io/slipstream/a:7" and b["image"] == "x"
    assert cm["data"] == {"w.toml": "b = 2"} and re.fullmatch(r"w-config-[a-z0-9]{10}", cm["metadata"]["name"])
    assert dep["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"] == cm["metadata"]["name"]
    assert dep["metadata"]["namespace"] == cm["metadata"]["namespace"] == "ns"
    assert kl.build(base)[1]["metadata"]["name"] != cm["metadata"]["name"]  # content changes the hash


@pytest.mark.parametrize(
    ("body", "error"),
    [
        ({"resources": ["d.yaml"], "replicas": [{"name": "w", "count": 2}]}, "outside the subset"),
        ({"resources": ["d.yaml"], "patches": [{"patch": "{kind: Deployment, metadata: {name: nope}}"}]}, "matches no"),
        ({"resources": ["d.yaml", "d.yaml"]}, "defined twice"),
        ({"configMapGenerator": [{"name": "c", "files": ["../escape.toml"]}]}, "outside the kustomization"),
    ],
)
def test_renderer_rejects_what_it_cannot_render_faithfully(tmp_path: Path, body: dict[str, Any], error: str) -> None:
    (tmp_path / "escape.toml").write_text("x = 1\n")
    root = _kustomization(tmp_path / "k", body, {"d.yaml": [DEPLOYMENT]})
    with pytest.raises(kl.KustomizeError, match=error):
        kl.build(root)
