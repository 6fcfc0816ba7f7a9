"""Offline checks of the sandbox tool service's prod overlay (deploy/k8s/overlays/prod/tool-service-code).

A Deployment of its own beside tool-service: the `code` tool set only (options the sandbox host
accepts), at least two replicas, KEDA scaling on the calls its own pods hold, its own PDB, the
sandbox node pool only, and no selector of tool-service's picking up its pods or the reverse.
"""

from __future__ import annotations

import msgspec
import pytest
from deploy_helpers import find, mounted_toml, pod_specs, render, service_containers

from slipstream.tool_service.config import ToolServiceConfig
from slipstream.tool_service.sandboxes import SandboxSetOptions

pytestmark = pytest.mark.unit

OVERLAY = "prod/tool-service-code"


def test_the_code_replicas_serve_only_the_sandbox_host_on_the_sandbox_nodes() -> None:
    objs = render(OVERLAY)
    [(owner, spec)] = pod_specs(objs)
    assert owner == "Deployment/tool-service-code"
    [container] = service_containers(spec)
    cfg = msgspec.convert(mounted_toml(objs, spec, container), ToolServiceConfig)
    assert cfg.serve.sets == ["code"]
    options = msgspec.convert(cfg.serve.options["code"], SandboxSetOptions)
    assert options.root.startswith("/tmp/")  # the emptyDir: sandboxes never land on the image's filesystem
    assert spec["nodeSelector"] == {"slipstream/sandbox": "true"}
    assert [t["key"] for t in spec["tolerations"]] == ["slipstream/sandbox"]
    [tmp] = [v for v in spec["volumes"] if v["name"] == "tmp"]
    assert tmp["emptyDir"]["sizeLimit"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True


def test_keda_keeps_at_least_two_code_replicas_and_counts_only_their_calls() -> None:
    from slipstream.telemetry.metrics import prom_name
    from slipstream.tool_service.server import IN_FLIGHT

    objs = render(OVERLAY)
    so = find(objs, "ScaledObject", "tool-service-code")
    target = find(objs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    assert "replicas" not in target["spec"] and so["spec"]["minReplicaCount"] >= 2
    name = target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["metadata"]["query"] == f'sum({prom_name(IN_FLIGHT.name)}{{app_kubernetes_io_name="{name}"}})'


def test_code_and_tool_service_selectors_never_pick_each_others_pods() -> None:
    code, plain = render(OVERLAY), render("prod")
    pods = {
        "code": find(code, "Deployment", "tool-service-code")["spec"]["template"]["metadata"]["labels"],
        "plain": find(plain, "Deployment", "tool-service")["spec"]["template"]["metadata"]["labels"],
    }
    for objs, name, own, other in (
        (code, "tool-service-code", "code", "plain"),
        (plain, "tool-service", "plain", "code"),
    ):
        for sel in (
            find(objs, "Deployment", name)["spec"]["selector"]["matchLabels"],
            find(objs, "Service", name)["spec"]["selector"],
            find(objs, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"],
        ):
            assert sel.items() <= pods[own].items() and not sel.items() <= pods[other].items(), sel
