"""The config each service container of a rendered overlay starts with, and where a run's services disagree.

Why: one training run is configured in nine places: seven TOML files (one per service, mounted
from ConfigMaps), the shared `slipstream-env` ConfigMap and the `slipstream-credentials` Secret.
A run whose learner steps on 8 groups while the task source paces for 4, or whose workers sample
at another temperature than the learner assumes, deploys cleanly and trains badly. This module
resolves every service container the way the service itself would at start (the TOML its
`--config` points at, then the `SLIPSTREAM_<SECTION>__<FIELD>` variables of its `envFrom` and
`env`), and `mismatches` lists every rule of one run that the resolved configs break.

A Secret the overlay does not render (prod creates it out of band) resolves to a placeholder
naming the key, so two containers reading the same key still compare equal.

Usage: python deploy/tools/pod_config.py deploy/k8s/overlays/prod [more overlays ...]
(prints each container's resolved config as JSON, then the mismatches; exit 1 if any)
"""

from __future__ import annotations

import base64
import importlib.util
import json
import re
import shlex
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec

from slipstream.runtime import config as runtime_config

Obj = dict[str, Any]
REPO = Path(__file__).resolve().parents[2]

# Services that must share the run's Redis: the learner's lease, the publisher's fence, the task
# source's statistics, the gate's history and promoted pointer.
REDIS_SERVICES = ("learner", "weight-publisher", "task-source", "eval-gate")
# Services that load the policy: they must start from the same version 0 and tokenizer.
MODEL_SERVICES = ("rollout-worker", "learner", "eval-gate")
# Where each service keeps its per-environment options.
ENV_OPTIONS = {
    "task-source": ("tasks", "env_options"),
    "reward-model": ("reward", "env_options"),
    "rollout-worker": ("worker", "env_options"),
    "eval-gate": ("gate", "env_options"),
    "tool-service": ("serve", "options"),
}
# What makes two [store] sections the same object store.
STORE_FIELDS = ("type", "url", "endpoint_url", "region", "addressing_style")
# (task-source [tasks] field, learner [learner] field) pairs that must be equal.
PACING = (
    ("groups_per_step", "groups_per_step"),
    ("max_staleness", "max_staleness"),
    ("max_steps", "max_steps"),
    ("learner_checkpoint_every", "checkpoint_every"),
)


class PodConfigError(ValueError):
    """A container's config cannot be resolved: a missing ConfigMap or key, or an invalid value."""


@dataclass(frozen=True)
class PodConfig:
    """One service container and the config it resolves."""

    owner: str  # "Deployment/learner", "RayJob/learner"
    container: str
    service: str  # the config file's stem: /etc/slipstream/<service>.toml
    config: msgspec.Struct

    def get(self, section: str, field: str) -> Any:
        return getattr(getattr(self.config, section), field)


def _table() -> Any:
    name = "service_table"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("service_table.py"))
        assert spec and spec.loader
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def _find(objs: list[Obj], kind: str, name: str) -> Obj | None:
    hits = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return hits[0] if hits else None


def _templates(node: Any, path: str = "") -> Iterator[tuple[str, Obj]]:
    """(path, pod template) for every pod template in an object (workloads and custom resources)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "template" and isinstance(value, dict) and "containers" in value.get("spec", {}):
                yield f"{path}/{key}", value
            else:
                yield from _templates(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            yield from _templates(item, f"{path}/{i}")


def _commands(obj: Obj) -> Iterator[tuple[Obj, Obj, list[str]]]:
    """(pod spec, container, argv after the image's entry point) for every container of `obj`."""
    for path, template in _templates(obj.get("spec", {})):
        spec = template["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            argv = [str(a) for a in c.get("args", [])]
            # A RayJob's driver runs on the head: its command line is the job's entrypoint.
            if obj["kind"] == "RayJob" and "headGroupSpec" in path and c is spec["containers"][0]:
                argv = shlex.split(obj["spec"]["entrypoint"])
            yield spec, c, argv


def _without_user(url: str) -> str:
    """A Redis URL without its user and password: the same server whoever connects."""
    if url.startswith("<secret "):  # prod's per-service keys, unrendered: one Secret, one server
        return re.sub(r"redis-url-[a-z-]+", "redis-url-<service>", url)
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc.rpartition("@")[2], parts.path, parts.query, parts.fragment))


def _secret_value(objs: list[Obj], name: str, key: str) -> str:
    secret = _find(objs, "Secret", name)
    if secret is None:
        return f"<secret {name}/{key}>"
    if key in secret.get("stringData", {}):
        return str(secret["stringData"][key])
    if key in secret.get("data", {}):
        return base64.b64decode(secret["data"][key]).decode()
    raise PodConfigError(f"Secret {name} has no key {key!r}")


def _config_map(objs: list[Obj], name: str, owner: str) -> dict[str, str]:
    cm = _find(objs, "ConfigMap", name)
    if cm is None:
        raise PodConfigError(f"{owner} reads ConfigMap {name}, which is not among the rendered objects")
    return {k: str(v) for k, v in cm.get("data", {}).items()}


def environment(objs: list[Obj], container: Obj, owner: str) -> dict[str, str]:
    """The container's environment as the kubelet would build it (fieldRefs as placeholders)."""
    env: dict[str, str] = {}
    for src in container.get("envFrom", []):
        if "configMapRef" in src:
            env.update(_config_map(objs, src["configMapRef"]["name"], owner))
        elif "secretRef" in src:
            secret = _find(objs, "Secret", src["secretRef"]["name"])
            if secret is not None:
                env.update({k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()})
    for e in container.get("env", []):
        ref = e.get("valueFrom", {})
        if "value" in e:
            env[e["name"]] = str(e["value"])
        elif "secretKeyRef" in ref:
            env[e["name"]] = _secret_value(objs, ref["secretKeyRef"]["name"], ref["secretKeyRef"]["key"])
        elif "configMapKeyRef" in ref:
            data = _config_map(objs, ref["configMapKeyRef"]["name"], owner)
            env[e["name"]] = data[ref["configMapKeyRef"]["key"]]
        elif "fieldRef" in ref:
            env[e["name"]] = f"<{ref['fieldRef']['fieldPath']}>"
    return env


def _mounted_file(objs: list[Obj], spec: Obj, container: Obj, path: str, owner: str) -> str:
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    if not mounts:
        raise PodConfigError(f"{owner}: no volume is mounted where --config {path} points")
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    volume = next((v for v in spec.get("volumes", []) if v["name"] == mount["name"]), None)
    if volume is None or "configMap" not in volume:
        raise PodConfigError(f"{owner}: --config {path} is not on a ConfigMap volume")
    data = _config_map(objs, volume["configMap"]["name"], owner)
    key = path[len(mount["mountPath"].rstrip("/")) + 1 :]
    if key not in data:
        raise PodConfigError(f"{owner}: ConfigMap {volume['configMap']['name']} has no {key!r}")
    return data[key]


def resolve(objs: list[Obj]) -> list[PodConfig]:
    """Every container started with `--config`, resolved: TOML, then its environment."""
    table = _table()
    out: list[PodConfig] = []
    for obj in objs:
        for spec, container, argv in _commands(obj):
            if "--config" not in argv:
                continue
            owner = f"{obj['kind']}/{obj['metadata']['name']}/{container['name']}"
            path = argv[argv.index("--config") + 1]
            service = Path(path).stem
            if service not in table.SERVICES:
                raise PodConfigError(f"{owner}: --config {path} is not named <service>.toml")
            cls = table.config_class(service)
            text = _mounted_file(objs, spec, container, path, owner)
            try:
                tree = tomllib.loads(text)
                env = runtime_config.env_layer(cls, environment(objs, container, owner))
                for section, values in env.items():
                    tree.setdefault(section, {}).update(values)
                cfg = runtime_config.build(cls, tree, where=owner)
            except (tomllib.TOMLDecodeError, runtime_config.ConfigError) as exc:
                raise PodConfigError(f"{owner}: {exc}") from exc
            out.append(PodConfig(f"{obj['kind']}/{obj['metadata']['name']}", container["name"], service, cfg))
    return out


def _disagree(pods: list[PodConfig], what: str, value: Any) -> list[str]:
    """One line when the pods do not all have the same `value(pod)`."""
    seen: dict[str, list[str]] = {}
    for p in pods:
        seen.setdefault(repr(value(p)), []).append(f"{p.owner}/{p.container}")
    if len(seen) <= 1:
        return []
    return [f"{what} differs: " + "; ".join(f"{v} in {', '.join(who)}" for v, who in seen.items())]


def _holds_options(p: PodConfig, env: str) -> bool:
    if p.service == "eval-gate":
        return env in p.get("gate", "envs")
    if p.service == "tool-service":
        return env in p.get("serve", "sets")
    # A sub-agent pool replica plays the options each request carries, none of its own.
    return not (p.service == "rollout-worker" and p.get("pool", "subagents"))


def _rank_mismatches(learner: PodConfig, publishers: list[PodConfig]) -> list[str]:
    """A learner's own publishers must be one per rank: each [publisher] ranks = [learner] ranks, ranks 0..N-1 once."""
    if not publishers:
        return []
    n = learner.get("learner", "ranks")
    found = sorted((p.get("publisher", "rank"), p.get("publisher", "ranks")) for p in publishers)
    if found == [(r, n) for r in range(n)]:
        return []
    return [f"{learner.owner}: learner.ranks={n} needs one publisher per rank, found (rank, ranks) {found}"]


def mismatches(pods: list[PodConfig]) -> list[str]:
    """Every rule of one run that `pods` break, as readable lines (empty: consistent)."""
    out: list[str] = []
    by: dict[str, list[PodConfig]] = {}
    for p in pods:
        by.setdefault(p.service, []).append(p)
    out += _disagree(pods, "service.run_id", lambda p: p.get("service", "run_id"))
    out += _disagree(pods, "bus (type, url)", lambda p: (p.get("bus", "type"), p.get("bus", "url")))
    stored = [p for p in pods if hasattr(p.config, "store")]
    out += _disagree(stored, f"store {STORE_FIELDS}", lambda p: tuple(p.get("store", f) for f in STORE_FIELDS))
    redis = [p for s in REDIS_SERVICES for p in by.get(s, [])]
    out += [f"{p.owner}/{p.container}: service.redis_url is empty" for p in redis if not p.get("service", "redis_url")]
    out += _disagree(
        [p for p in redis if p.get("service", "redis_url")],
        "service.redis_url (server and db; each service has its own ACL user)",
        lambda p: _without_user(str(p.get("service", "redis_url"))),
    )
    models = [p for s in MODEL_SERVICES for p in by.get(s, [])]
    out += _disagree(
        models,
        "model (path, preset, seed)",
        lambda p: (p.get("model", "path"), p.get("model", "preset"), p.get("model", "seed")),
    )
    for learner in by.get("learner", []):
        for source in by.get("task-source", []):
            for tasks_field, learner_field in PACING:
                if source.get("tasks", tasks_field) != learner.get("learner", learner_field):
                    out.append(
                        f"{source.owner} tasks.{tasks_field}={source.get('tasks', tasks_field)} but "
                        f"{learner.owner} learner.{learner_field}={learner.get('learner', learner_field)}"
                    )
        for worker in by.get("rollout-worker", []):
            if worker.get("worker", "temperature") != learner.get("learner", "sampling_temperature"):
                out.append(
                    f"{worker.owner} worker.temperature={worker.get('worker', 'temperature')} but {learner.owner} "
                    f"learner.sampling_temperature={learner.get('learner', 'sampling_temperature')}"
                )
        if learner.get("learner", "lease_handover_s") >= learner.get("service", "drain_timeout_s"):
            out.append(f"{learner.owner}: learner.lease_handover_s must fit inside service.drain_timeout_s")
        publishers = [p for p in by.get("weight-publisher", []) if p.owner == learner.owner]
        for publisher in publishers:
            if publisher.get("publisher", "staging_dir") != learner.get("learner", "staging_dir"):
                out.append(f"{learner.owner}: publisher.staging_dir != learner.staging_dir")
        out += _rank_mismatches(learner, publishers)
    envs = {e for p in by.get("task-source", []) for e in p.get("tasks", "envs")}
    for env in sorted(envs):
        # eval-gate holds options only for the environments of its suite, the tool-service only for
        # the environments whose tools it serves.
        holders = [p for s in ENV_OPTIONS for p in by.get(s, []) if _holds_options(p, env)]
        out += _disagree(
            holders, f"env_options[{env!r}]", lambda p, env=env: p.get(*ENV_OPTIONS[p.service]).get(env, {})
        )
    return out


def main(argv: list[str]) -> int:
    spec = importlib.util.spec_from_file_location("kustomize", Path(__file__).with_name("kustomize.py"))
    assert spec and spec.loader
    kl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kl)
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    objs = [o for path in argv for o in kl.build(path)]
    pods = resolve(objs)
    for p in pods:
        print(json.dumps({"pod": p.owner, "container": p.container, "config": msgspec.to_builtins(p.config)}))
    problems = mismatches(pods)
    for line in problems:
        print("MISMATCH " + line, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
