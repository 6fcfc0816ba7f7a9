"""Offline checks of the search tool service's prod overlay (deploy/k8s/overlays/prod/tool-service-search).

A Deployment of its own beside tool-service: the `search` tool set only, at least two replicas
(one may die with calls in flight; the other answers them), KEDA scaling on the calls its own
pods hold, its own PDB, S3 credentials from the Secret, and no selector of tool-service's
(Deployment, Service, PDB) picking up its pods or the reverse.
"""

from __future__ import annotations

from typing import Any

import pytest
from deploy_helpers import find, mounted_toml, pod_specs, render, service_containers

from slipstream.tool_service.config import ToolServiceConfig
from slipstream.tool_service.search import OPTIONS

pytestmark = pytest.mark.unit

OVERLAY = "prod/tool-service-search"


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def test_the_search_replicas_serve_only_search_from_the_store_with_their_options_checked() -> None:
    import msgspec

    objs = render(OVERLAY)
    [(owner, spec)] = pod_specs(objs)
    assert owner == "Deployment/tool-service-search"
    [container] = service_containers(spec)
    raw = mounted_toml(objs, spec, container)
    cfg = msgspec.convert(raw, ToolServiceConfig)
    assert cfg.serve.sets == ["search"] and cfg.store.type == "s3"
    options = cfg.serve.options["search"]
    assert set(options) <= OPTIONS and options["index"].startswith("indexes/")
    env = {e["name"]: e for e in container["env"]}
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert env[key]["valueFrom"]["secretKeyRef"]["name"] == "slipstream-credentials"
    assert env["OTEL_SERVICE_NAME"]["value"] == "tool-service-search"


def test_keda_keeps_at_least_two_search_replicas_and_counts_only_their_calls() -> None:
    from slipstream.telemetry.metrics import prom_name
    from slipstream.tool_service.server import IN_FLIGHT

    objs = render(OVERLAY)
    so = find(objs, "ScaledObject", "tool-service-search")
    target = find(objs, "Deployment", so["spec"]["scaleTargetRef"]["name"])
    assert "replicas" not in target["spec"] and so["spec"]["minReplicaCount"] >= 2
    name = target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"]
    (trigger,) = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus"
    assert trigger["metadata"]["query"] == f'sum({prom_name(IN_FLIGHT.name)}{{app_kubernetes_io_name="{name}"}})'


def test_search_and_tool_service_selectors_never_pick_each_others_pods() -> None:
    search = render(OVERLAY)
    plain = render("prod")
    pods = {
        "search": find(search, "Deployment", "tool-service-search")["spec"]["template"]["metadata"]["labels"],
        "plain": find(plain, "Deployment", "tool-service")["spec"]["template"]["metadata"]["labels"],
    }

    def selectors(objs: list[dict[str, Any]], name: str) -> list[dict[str, str]]:
        return [
            find(objs, "Deployment", name)["spec"]["selector"]["matchLabels"],
            find(objs, "Service", name)["spec"]["selector"],
            find(objs, "PodDisruptionBudget", name)["spec"]["selector"]["matchLabels"],
        ]

    for sel in selectors(search, "tool-service-search"):
        assert _selects(sel, pods["search"]) and not _selects(sel, pods["plain"]), sel
    for sel in selectors(plain, "tool-service"):
        assert _selects(sel, pods["plain"]) and not _selects(sel, pods["search"]), sel
