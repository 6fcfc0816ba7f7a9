"""`service_main`: what every service's `__main__` calls.

Config is parsed first, before anything heavy is imported, so `--help` and `--print-config`
answer at once; the service module (which may pull in torch or vLLM) is imported only after,
from a "package.module:callable" string.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

from slipstream.runtime.config import parse_cli

C = TypeVar("C", bound=msgspec.Struct)


def load_factory(spec: str) -> Callable[[Any], Any]:
    """Import "package.module:callable" and return the callable."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"service factory {spec!r} must look like 'package.module:callable'")
    module = importlib.import_module(module_name)
    try:
        factory = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"service factory {spec!r}: module {module_name} has no attribute {attr!r}") from None
    if not callable(factory):
        raise ValueError(f"service factory {spec!r} is not callable")
    return factory  # type: ignore[no-any-return]


def service_main(name: str, config_cls: type[C], factory: str, argv: Sequence[str] | None = None) -> int:
    """Parse config, set up telemetry, build the service with `factory(config)`, run it; the exit code.

    The config class must have `service` (ServiceSection) and `telemetry` (TelemetryConfig)
    sections. An empty `service.replica` is filled with `<hostname>-<pid>` before the factory runs.
    """
    cfg = parse_cli(config_cls, argv, prog=f"slipstream-{name}", description=f"Slipstream {name} service.")
    # Only now the heavy imports: structlog, OpenTelemetry, the service module.
    from slipstream.runtime.lifecycle import EXIT_FAILED, replica_id, run_service
    from slipstream.telemetry.logs import get_logger, setup_logging

    service_cfg = cfg.service  # type: ignore[attr-defined]
    telemetry_cfg = cfg.telemetry  # type: ignore[attr-defined]
    service_cfg.replica = replica_id(service_cfg)
    setup_logging(name, telemetry_cfg, replica=service_cfg.replica, run_id=service_cfg.run_id)
    log = get_logger("slipstream.runtime")
    try:
        service = load_factory(factory)(cfg)
    except Exception:
        # The process never got to `starting`; say why before exiting non-zero.
        log.error("service construction failed", factory=factory, exc_info=True)
        return EXIT_FAILED
    if service.name != name:
        log.warning("service name differs from its entry point", entry_point=name, service=service.name)
    return run_service(service, service_cfg, telemetry_cfg)
