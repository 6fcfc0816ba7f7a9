"""Runs: the run file, the training plan it resolves to, the services' config from it, and the driver.

The names below load on first use (PEP 562), so that a light module of the package (the
simulator's preferences, the swarm demo's flags) can be imported without msgspec, e.g. while
`slipstream --help` builds its parser.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from slipstream.run.plan import RunSummary, TrainingPlan, run_env, service_env, service_overrides
    from slipstream.run.runfile import RunFile, RunFileError, env_file, load, parse_env_file

_HOME = {
    "RunSummary": "plan",
    "TrainingPlan": "plan",
    "run_env": "plan",
    "service_env": "plan",
    "service_overrides": "plan",
    "RunFile": "runfile",
    "RunFileError": "runfile",
    "env_file": "runfile",
    "load": "runfile",
    "parse_env_file": "runfile",
}

__all__ = [
    "RunFile",
    "RunFileError",
    "RunSummary",
    "TrainingPlan",
    "env_file",
    "load",
    "parse_env_file",
    "run_env",
    "service_env",
    "service_overrides",
]


def __getattr__(name: str) -> Any:
    module = _HOME.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.run' has no attribute {name!r}")
    return getattr(importlib.import_module(f"slipstream.run.{module}"), name)
