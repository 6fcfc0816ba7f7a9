"""The tool-service's `code` set as a run renders it: a sandbox host with two tools, options its own."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.envs.code.service import CREATE, ROUTE_PREFIX, caller_registry, route_for
from slipstream.run.plan import TrainingPlan, run_env
from slipstream.runtime.config import resolve
from slipstream.tool_service.config import ToolServiceConfig
from slipstream.tool_service.service import ToolService
from slipstream.tool_service.toolsets import ToolSetError

pytestmark = pytest.mark.unit


def test_a_code_run_with_tool_service_replicas_serves_the_sandbox_host(tmp_path: Path) -> None:
    plan = TrainingPlan(env="code", env_options={"sandbox": "service", "max_turns": 4}, tool_service_replicas=2)
    environ = run_env(plan)
    assert environ["SLIPSTREAM_TOOLS__TRANSPORT"] == "nats"
    assert json.loads(environ["SLIPSTREAM_SERVE__SETS"]) == ["code"]
    assert "SLIPSTREAM_SERVE__OPTIONS" not in environ  # the env's options are not the host's
    assert json.loads(environ["SLIPSTREAM_WORKER__ENV_OPTIONS"])["code"]["sandbox"] == "service"
    where = {"SLIPSTREAM_SERVICE__REPLICA": "tool-service-7f9c-x2"}
    where["SLIPSTREAM_SERVE__OPTIONS"] = json.dumps({"code": {"root": str(tmp_path)}})  # not the shared /tmp
    cfg = resolve(ToolServiceConfig, environ={**environ, **where})
    service = ToolService(cfg)
    assert service.sandboxes is not None
    names = list(service.registry.names)
    assert names[0] == CREATE and names[1].startswith(f"{ROUTE_PREFIX}tool_service_tool_service_7f9c_x2_")
    assert service.status()["sandboxes"] == {
        "route": names[1],
        "open": 0,
        "created": 0,
        "forked": 0,
        "closed": 0,
        "reaped": 0,
    }
    assert [p.name for p in tmp_path.iterdir()] == [names[1]]  # the host's own directory (with its pid)


def test_routes_are_tool_names_and_differ_between_processes() -> None:
    a, b = route_for("tool-service/a"), route_for("tool-service/a")
    assert a != b and a.startswith("sandbox_tool_service_a_")
    assert route_for("Ω/…").startswith("sandbox_replica_")
    assert list(caller_registry(10.0).names) == [CREATE]


def test_a_bad_code_set_option_fails_the_replica_naming_it() -> None:
    cfg = resolve(
        ToolServiceConfig,
        environ={},
        overrides={"serve": {"sets": ["code"], "options": {"code": {"idle_ttl": 5}}}},
    )
    with pytest.raises(ToolSetError, match="idle_ttl"):
        ToolService(cfg)
