"""The deployables as deploy/ sees them: name, Python package, console script, config class.

Why: the images, manifests, Tiltfile and their tests all name the same five services; this table
says once how a service name maps onto its package (`reward-model` -> `slipstream.reward_model`),
its entry point and its typed config class, so the checks compare manifests against the code.
"""

from __future__ import annotations

import importlib
import re
import tomllib
from pathlib import Path

import msgspec

from slipstream.bus.config import BusConfig
from slipstream.runtime.section import ServiceSection
from slipstream.store.config import StoreConfig
from slipstream.telemetry.config import TelemetryConfig

REPO = Path(__file__).resolve().parents[2]

SERVICES: tuple[str, ...] = ("rollout-worker", "reward-model", "learner", "weight-publisher", "eval-gate")

CONFIG_CLASSES: dict[str, str] = {
    "rollout-worker": "RolloutWorkerConfig",
    "reward-model": "RewardModelConfig",
    "learner": "LearnerConfig",
    "weight-publisher": "WeightPublisherConfig",
    "eval-gate": "EvalGateConfig",
}


class SharedSections(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The sections every service config carries; stands in for a service whose config.py does
    not exist yet, so its deploy files are still checked key by key."""

    service: ServiceSection = msgspec.field(default_factory=ServiceSection)
    bus: BusConfig = msgspec.field(default_factory=BusConfig)
    store: StoreConfig = msgspec.field(default_factory=StoreConfig)
    telemetry: TelemetryConfig = msgspec.field(default_factory=TelemetryConfig)


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
    """The service's config class; SharedSections until services/<service>/.../config.py exists.

    Once the file exists, an import error or a missing class is an error, never a fallback.
    """
    if not (source_dir(service) / "config.py").exists():
        return SharedSections
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
