"""What the deploy/ test modules share: the deploy tools, the rendered overlays, and lookups over them.

deploy/tools holds plain scripts, not an installed package, so they are loaded by path (once:
later loads find them in `sys.modules`). `render` and `crds` are cached, so the test_deploy_*
modules render each overlay once between them.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

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


kl = _tool("kustomize")
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
