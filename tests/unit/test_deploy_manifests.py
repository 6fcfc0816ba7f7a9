"""Offline checks of the Kubernetes manifests: overlays, schemas, security, prod's scaling, NATS Helm values, OTel.

Every overlay is rendered with the real kustomize (`kubectl kustomize`, deploy/tools/kustomize.py)
and every object validated strictly against the Kubernetes 1.33 schemas bundled with
kubernetes-validate; custom resources against the CRDs in deploy/crds, their pod templates as
core/v1 PodTemplateSpecs. KEDA triggers are compared with the subject table. (Configs: test_deploy_config.py; images:
test_deploy_images.py; shared helpers: deploy_helpers.py.)
"""

from __future__ import annotations

import base64
import json
import re
import shlex
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from deploy_helpers import (
    DEPLOY,
    K8S_VERSION,
    OVERLAYS,
    UID,
    _tool,
    crds,
    crdv,
    find,
    kl,
    mounted_toml,
    pod_specs,
    podcfg,
    render,
)

from slipstream.bus.permissions import all_permissions, password_env
from slipstream.control.acl import ACCESS
from slipstream.schemas import subjects

pytestmark = pytest.mark.unit


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
    prod = ("rollout-worker", "subagent-pool", "reward-model", "learner", "eval-gate", "task-source", "tool-service")
    assert {f"prod/{s}" for s in prod} <= set(OVERLAYS)


def test_shipped_crds_are_valid_crds_and_strict() -> None:
    assert {k for _, k in crds().schemas} == {"ScaledObject", "RayJob", "RayCluster"}
    for crd in crds().crds:
        kubernetes_validate.validate(crd, K8S_VERSION, strict=True)
    scaled = find(render("prod"), "ScaledObject", "reward-model")
    bad = {**scaled, "spec": {**scaled["spec"], "minReplicas": 1}}
    with pytest.raises(crdv.CustomResourceError, match="minReplicas"):
        crds().validate(bad)


def test_references_resolve_inside_each_full_overlay() -> None:
    external = {"prod": {("Secret", "slipstream-credentials"), ("Secret", "slipstream-bus-users")}, "dev": set()}
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


# ---------------------------------------------------------------- security and pod layout


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
    # Each rank stages its part on its own worker pod: a publisher sits on every worker pod, none on the head.
    assert "initContainers" not in head
    assert all(v.get("emptyDir", {}).get("medium") != "Memory" for v in head["volumes"])
    for group in cluster["workerGroupSpecs"]:
        _assert_publisher_sidecar(objs, group["template"]["spec"], "ray-worker", learner_toml=driver_toml)


def test_the_rayjob_runs_the_learner_as_driver_of_one_rank_per_gpu_worker() -> None:
    from slipstream.learner.config import LearnerConfig
    from slipstream.runtime import config as runtime_config

    objs = render("prod/learner-ray")
    job = find(objs, "RayJob", "learner")["spec"]
    cluster = job["rayClusterSpec"]
    head = cluster["headGroupSpec"]["template"]["spec"]
    argv = shlex.split(job["entrypoint"])
    assert argv[:3] == ["python", "-m", "slipstream.learner"]
    # The ConfigMap the entrypoint reads, parsed by the learner's own loader (defaults -> TOML -> env -> flags).
    path = argv[argv.index("--config") + 1]
    mount = next(m for m in head["containers"][0]["volumeMounts"] if path.startswith(m["mountPath"] + "/"))
    volume = next(v for v in head["volumes"] if v["name"] == mount["name"])
    text = find(objs, "ConfigMap", volume["configMap"]["name"])["data"][path[len(mount["mountPath"]) + 1 :]]
    args = runtime_config.parse_args(LearnerConfig, argv[3:])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "learner.toml").write_text(text)
        args.config = str(Path(tmp) / "learner.toml")
        cfg = runtime_config.resolve(LearnerConfig, args, environ={})
    groups = cluster["workerGroupSpecs"]
    assert cfg.learner.ranks > 1 and cfg.learner.ray_address == "auto"
    assert cfg.learner.rank_resource, "without rank_resource Ray may put rank r next to another rank's publisher"
    assert [g["groupName"] for g in groups] == [f"rank-{r}" for r in range(cfg.learner.ranks)]
    # Ranks take one CPU each: the head offers none, every GPU worker exactly one, so one rank per GPU pod.
    assert cluster["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]
    # Resolved as the sidecars start (TOML, then env); slipstream-env comes from prod/common.
    resolved = podcfg.resolve(objs + render("prod/common"))
    publishers = [
        (p.get("publisher", "rank"), p.get("publisher", "ranks")) for p in resolved if p.service == "weight-publisher"
    ]
    for r, group in enumerate(groups):
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == 1, group["groupName"]
        params = group["rayStartParams"]
        assert params["num-cpus"] == "1"
        # KubeRay appends `--resources=<value>` to the `ray start` line a shell runs: the shell's word is JSON.
        (word,) = shlex.split(params["resources"])
        advertised = json.loads(word)
        assert advertised == {cfg.learner.rank_resource.format(rank=r): 1}, group["groupName"]
        spec = group["template"]["spec"]
        assert group["template"]["metadata"]["labels"]["slipstream.io/rank"] == str(r)
        (worker,) = spec["containers"]
        assert worker["resources"]["limits"]["nvidia.com/gpu"] == 1
        env = {e["name"]: e.get("value") for e in worker["env"]}
        assert env["RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO"] == "0"  # a CPU-only rank actor still sees its pod's GPU
        assert env["RAY_worker_niceness"] == "0"  # the rank runs at its publisher sidecar's priority, not Ray's 15
        # This pod's publisher stores rank r's part: its env, through the publisher's own loader.
        (sidecar,) = spec["initContainers"]
        pub_env = {e["name"]: e.get("value") for e in sidecar["env"]}
        assert (pub_env["SLIPSTREAM_PUBLISHER__RANK"], pub_env["SLIPSTREAM_PUBLISHER__RANKS"]) == (
            str(r),
            str(cfg.learner.ranks),
        )
    assert sorted(publishers) == [(r, cfg.learner.ranks) for r in range(cfg.learner.ranks)]
    assert cfg.model.device == "auto"
    # Checkpoint shards pass through [learner] shared_dir: one ReadWriteMany claim that the head and
    # every rank's pod mount at that same path (ranks on other pods write where the driver reads).
    assert cfg.learner.shared_dir
    claim = find(objs, "PersistentVolumeClaim", "learner-shared")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for pod in [head, *(g["template"]["spec"] for g in groups)]:
        shared = {
            v["name"] for v in pod["volumes"] if v.get("persistentVolumeClaim", {}).get("claimName") == "learner-shared"
        }
        mounts = {m["mountPath"] for c in pod["containers"] for m in c["volumeMounts"] if m["name"] in shared}
        assert mounts == {cfg.learner.shared_dir}, pod["containers"][0]["name"]


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


# ---------------------------------------------------------------- prod: GPUs, PDBs, KEDA


def test_prod_gpu_services_request_gpus_in_limits_on_gpu_nodes() -> None:
    objs = render("prod")
    for name in ("rollout-worker", "subagent-pool", "learner"):
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
    assert set(scaled) == {"rollout-worker", "subagent-pool", "reward-model", "eval-gate", "tool-service"}
    for name, so in scaled.items():
        if name == "tool-service":
            continue  # request/reply: no consumer backlog; see the next test
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
    assert scaled["subagent-pool"]["spec"]["minReplicaCount"] == 1
    assert scaled["eval-gate"]["spec"]["minReplicaCount"] == 1
    assert find(objs, "Deployment", "learner")["spec"]["replicas"] == 1


def test_keda_scales_the_tool_service_on_the_calls_its_replicas_hold() -> None:
    # Tool calls are core NATS request/reply (subjects.REQUESTS): no stream, so no lag to read.
    from slipstream.telemetry.metrics import prom_name
    from slipstream.tool_service.server import IN_FLIGHT

    objs = render("prod")
    so = find(objs, "ScaledObject", "tool-service")
    target = find(objs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    assert "replicas" not in target["spec"]
    (req,) = [r for r in subjects.REQUESTS if r.service == target["metadata"]["name"]]
    assert req.queue_group == "tool-service"
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    meta = trigger["metadata"]
    # The query sums the gauge the service exports (a renamed metric would leave KEDA reading nothing).
    assert meta["query"].strip() == f"sum({prom_name(IN_FLIGHT.name)})"
    assert meta["serverAddress"].startswith("http://") and int(meta["threshold"]) >= 1
    pod = target["spec"]["template"]["metadata"]["annotations"]
    assert pod["prometheus.io/scrape"] == "true" and pod["prometheus.io/path"] == "/metrics"
    # Never zero: with no replica every call fails at once and its episode is masked.
    assert so["spec"]["minReplicaCount"] >= 1


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


def test_a_kustomization_kustomize_refuses_fails_with_its_message_and_directory(tmp_path: Path) -> None:
    root = _kustomization(
        tmp_path / "k",
        {"resources": ["d.yaml"], "patches": [{"patch": "{kind: Deployment, metadata: {name: nope}}"}]},
        {"d.yaml": [DEPLOYMENT]},
    )
    with pytest.raises(kl.KustomizeError, match=r"kubectl kustomize .*/k: .*nope"):
        kl.build(root)


# ---------------------------------------------------------------- NATS users (least privilege)

bus_users = _tool("bus_users")
_BUS_USER_OF_IMAGE = {"learner-ray": "learner", "provision": "admin"}
# The rollout-worker image run as the sub-agent pool connects as the pool's own user.
_BUS_USER_OF_CONTAINER = {"subagent-pool": "subagent-pool"}


def test_generated_nats_users_are_current_with_the_subject_table() -> None:
    assert bus_users.main(["check"]) == 0, "run: python deploy/tools/bus_users.py write"
    values = yaml.safe_load((DEPLOY / "helm" / "nats" / "auth-values.yaml").read_text())
    users = [u["user"] for u in values["config"]["merge"]["authorization"]["users"]]
    assert users == [p.user for p in all_permissions()]
    assert all(
        u["password"] == f"<< ${password_env(u['user'])} >>"
        for u in values["config"]["merge"]["authorization"]["users"]
    )
    assert values["container"]["merge"]["envFrom"] == [{"secretRef": {"name": "slipstream-bus-users"}}]
    # The deny lists travel too: without them a reader's named create could redefine eval-gate's durable.
    worker = next(u for u in values["config"]["merge"]["authorization"]["users"] if u["user"] == "rollout-worker")
    assert worker["permissions"]["publish"]["deny"] == ["$JS.API.CONSUMER.CREATE.WEIGHTS.eval-gate.>"]


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_every_slipstream_container_connects_as_its_own_nats_user(overlay: str) -> None:
    known = {p.user for p in all_permissions()}
    seen: set[str] = set()
    for owner, spec in pod_specs(render(overlay)):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            m = re.search(r"(?:^|/)slipstream/([a-z-]+)", str(c["image"]))
            if not m:
                continue
            user = _BUS_USER_OF_CONTAINER.get(c["name"]) or _BUS_USER_OF_IMAGE.get(m.group(1), m.group(1))
            env = {e["name"]: e for e in c.get("env", [])}
            assert env["SLIPSTREAM_BUS__USER"].get("value") == user, f"{owner}/{c['name']}"
            ref = env["SLIPSTREAM_BUS__PASSWORD"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == password_env(user), f"{owner}/{c['name']}"
            assert ref["name"].startswith("slipstream-bus-users"), f"{owner}/{c['name']}"  # dev adds a hash
            assert user in known, f"{owner}/{c['name']}: {user} has no NATS user in the subject table"
            seen.add(user)
    assert "admin" in seen or overlay == "prod/learner-ray"


def test_dev_nats_runs_with_the_generated_users_and_a_password_for_each() -> None:
    objs = render("dev")
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith("slipstream-bus-users"))
    assert set(secret["data"]) == {password_env(p.user) for p in all_permissions()}
    nats = find(objs, "StatefulSet", "nats")
    (c,) = nats["spec"]["template"]["spec"]["containers"]
    assert c["args"][:2] == ["-c", "/etc/nats-auth/nats-auth.conf"]
    assert c["envFrom"][0]["secretRef"]["name"] == secret["metadata"]["name"]
    auth = next(v for v in nats["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth")
    cm = find(objs, "ConfigMap", auth["configMap"]["name"])
    assert cm["data"]["nats-auth.conf"] == (DEPLOY / "k8s/overlays/dev/infra/nats-auth.conf").read_text()


_REDIS_USER_OF_IMAGE = {"learner-ray": "learner"}


@pytest.mark.parametrize("overlay", ["dev", "prod", "prod/learner-ray"])
def test_every_redis_client_connects_as_its_own_acl_user(overlay: str) -> None:
    objs = render(overlay)
    for owner, spec in pod_specs(objs):
        for c in spec.get("containers", []) + spec.get("initContainers", []):
            m = re.search(r"(?:^|/)slipstream/([a-z-]+)", str(c["image"]))
            env = {e["name"]: e for e in c.get("env", [])}
            if not m or "SLIPSTREAM_SERVICE__REDIS_URL" not in env:
                continue
            user = _REDIS_USER_OF_IMAGE.get(m.group(1), m.group(1))
            assert user in ACCESS, f"{owner}/{c['name']}: {user} has no Redis ACL user (slipstream.control.acl)"
            ref = env["SLIPSTREAM_SERVICE__REDIS_URL"]["valueFrom"]["secretKeyRef"]
            assert ref["key"] == f"redis-url-{user}", f"{owner}/{c['name']}"


def test_dev_redis_runs_with_the_generated_acl_and_each_service_has_its_url() -> None:
    objs = render("dev")
    creds = next(
        o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith("slipstream-credentials")
    )
    for svc in bus_users.redis_services():
        url = base64.b64decode(creds["data"][f"redis-url-{svc}"]).decode()
        assert url == f"redis://{svc}:dev-{svc}@redis:6379/0"
    redis = find(objs, "Deployment", "redis")
    (c,) = redis["spec"]["template"]["spec"]["containers"]
    assert c["args"][-2:] == ["--aclfile", "/etc/redis-acl/users.acl"]
    acl = next(v for v in redis["spec"]["template"]["spec"]["volumes"] if v["name"] == "acl")
    secret = find(objs, "Secret", acl["secret"]["secretName"])
    assert base64.b64decode(secret["data"]["users.acl"]).decode() == bus_users.dev_redis_acl()
