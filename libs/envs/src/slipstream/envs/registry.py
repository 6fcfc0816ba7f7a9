"""The environment registry: environments plug in by name, with typed options.

A service names its environment in config (`env = "arith"`, plus an options table); `get_env`
turns that into an instance. The name is also the subject token of `tasks.<env>` and
`traj.*.<env>`, so it is restricted to characters NATS subjects allow.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec

from slipstream.envs.base import Environment

_NAME = re.compile(r"[a-z][a-z0-9_-]*")

ENVIRONMENTS: dict[str, type[Environment[Any]]] = {}

E = TypeVar("E", bound=type[Environment[Any]])


class EnvError(ValueError):
    """An unknown environment, an unknown option, or an option of the wrong type or value."""


def register(name: str) -> Callable[[E], E]:
    """Class decorator: register an environment under `name` (sets `cls.name`)."""
    if not _NAME.fullmatch(name):
        raise EnvError(f"environment name {name!r} must match {_NAME.pattern} (it is a NATS subject token)")

    def decorate(cls: E) -> E:
        existing = ENVIRONMENTS.get(name)
        if existing is not None and existing is not cls:
            raise EnvError(f"environment {name!r} is already registered by {existing.__module__}.{existing.__name__}")
        cls.name = name
        ENVIRONMENTS[name] = cls
        return cls

    return decorate


def parse_options(name: str, options: Mapping[str, Any]) -> msgspec.Struct:
    """Options for environment `name`, typed; strings from env vars or CLI flags are coerced."""
    cls = _lookup(name)
    known = cls.Options.__struct_fields__
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise EnvError(f"unknown option(s) {', '.join(unknown)} for environment {name!r}; known: {', '.join(known)}")
    try:
        return msgspec.convert(dict(options), cls.Options, strict=False)
    except msgspec.ValidationError as exc:
        raise EnvError(f"bad option for environment {name!r}: {exc}") from exc


def task_envs() -> list[str]:
    """Names of the registered environments that generate tasks (every one but traffic scorers)."""
    return sorted(name for name, cls in ENVIRONMENTS.items() if cls.has_tasks)


def get_env(name: str, /, **options: Any) -> Environment[Any]:
    """An instance of environment `name` with `options` (each default when not given)."""
    return _lookup(name)(parse_options(name, options))


def _lookup(name: str) -> type[Environment[Any]]:
    cls = ENVIRONMENTS.get(name)
    if cls is None:
        raise EnvError(f"unknown environment {name!r}; known: {', '.join(sorted(ENVIRONMENTS)) or '(none)'}")
    return cls
