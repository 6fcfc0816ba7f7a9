"""The deployables as deploy/ sees them: name, Python package, console script, config class.

Why: the images, manifests, Tiltfile and their tests all name the same seven services; this table
says once how a service name maps onto its package (`reward-model` -> `slipstream.reward_model`),
its entry point and its typed config class, so the checks compare manifests against the code.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import msgspec

REPO = Path(__file__).resolve().parents[2]

SERVICES: tuple[str, ...] = (
    "rollout-worker",
    "reward-model",
    "learner",
    "weight-publisher",
    "eval-gate",
    "task-source",
    "tool-service",
)

CONFIG_CLASSES: dict[str, str] = {
    "rollout-worker": "RolloutWorkerConfig",
    "reward-model": "RewardModelConfig",
    "learner": "LearnerConfig",
    "weight-publisher": "WeightPublisherConfig",
    "eval-gate": "EvalGateConfig",
    "task-source": "TaskSourceConfig",
    "tool-service": "ToolServiceConfig",
}


def package(service: str) -> str:
    """`reward-model` -> `slipstream.reward_model`."""
    if service not in SERVICES:
        raise KeyError(f"unknown service {service!r}; known: {', '.join(SERVICES)}")
    return "slipstream." + service.replace("-", "_")


def source_dir(service: str) -> Path:
    """services/<service>/src/slipstream/<pkg>."""
    return REPO / "services" / service / "src" / "slipstream" / package(service).split(".", 1)[1]


def console_script(service: str) -> str:
    return "slipstream-" + service


def config_class(service: str) -> type[msgspec.Struct]:
    """The service's config class (`slipstream.<pkg>.config.<Name>Config`); a missing module or
    class is an error naming it."""
    module = importlib.import_module(package(service) + ".config")
    cls = getattr(module, CONFIG_CLASSES[service], None)
    if cls is None:
        raise ImportError(f"{package(service)}.config has no class {CONFIG_CLASSES[service]}")
    return cls


def dependency_dirs(distribution: str) -> set[str]:
    """Repository directories of the slipstream-* packages a package needs, transitively,
    itself included (`slipstream-bus` -> {libs/bus, libs/schemas, libs/telemetry})."""
    dirs = {tomllib.loads(p.read_text())["project"]["name"]: p.parent for p in REPO.glob("*/*/pyproject.toml")}
    todo, out = [distribution], set()
    while todo:
        name = todo.pop()
        if name not in dirs:
            raise KeyError(f"no package named {name!r} under libs/, services/ or tools/")
        rel = str(dirs[name].relative_to(REPO))
        if rel in out:
            continue
        out.add(rel)
        for dep in tomllib.loads((dirs[name] / "pyproject.toml").read_text())["project"].get("dependencies", []):
            dep_name = re.split(r"[<>=!~ \[;]", dep, maxsplit=1)[0]
            if dep_name.startswith("slipstream-"):
                todo.append(dep_name)
    return out
