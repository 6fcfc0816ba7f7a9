"""Slipstream service runtime: typed config, the service lifecycle, probes and metrics over HTTP.

Importing this package stays light (config parsing only) so that a service's `--help` is
instant; the lifecycle (structlog, OpenTelemetry) loads on first use of its names (PEP 562).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from slipstream.runtime.config import ConfigError, dump, parse_cli, resolve
from slipstream.runtime.entrypoint import load_factory, service_main
from slipstream.runtime.section import ServiceSection
from slipstream.runtime.service import BaseService, Service

if TYPE_CHECKING:
    from slipstream.runtime.lifecycle import Runtime, State, run_service, serve
    from slipstream.runtime.probes import ProbeServer

_LAZY = {
    "Runtime": "slipstream.runtime.lifecycle",
    "State": "slipstream.runtime.lifecycle",
    "run_service": "slipstream.runtime.lifecycle",
    "serve": "slipstream.runtime.lifecycle",
    "ProbeServer": "slipstream.runtime.probes",
}

__all__ = [
    "BaseService",
    "ConfigError",
    "ProbeServer",
    "Runtime",
    "Service",
    "ServiceSection",
    "State",
    "dump",
    "load_factory",
    "parse_cli",
    "resolve",
    "run_service",
    "serve",
    "service_main",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'slipstream.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
