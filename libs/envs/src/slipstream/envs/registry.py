"""The environment registry: environments plug in by name, with typed options.

A service names its environment in config (`env = "arith"`, plus an options table); `get_env`
turns that into an instance. The name is also the subject token of `tasks.<env>` and
`traj.*.<env>`, so it is restricted to characters NATS subjects allow.

Plugins: a pip package registers an environment without touching this repository by naming it in
the entry-point group `slipstream.environments` (`sort = "my_pkg:Sort"`: the entry point's name is
the environment's name, its object the `Environment` subclass, or a module whose import registers
it). A plugin is imported the first time its name is looked up, so every process that builds
environments by name (worker, reward model, eval gate, task source) finds it, and a plugin that
fails to import breaks only the runs that name it, with an `EnvError` saying why.

An environment that holds something open for the whole process (the verifiers runner and the
processes beneath it) registers its closer with `on_close`; a process that plays episodes calls
`close_envs()` when it stops (the rollout worker's close), so none of it outlives the process.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

import msgspec

from slipstream.envs.base import Environment

_NAME = re.compile(r"[a-z][a-z0-9_-]*")

PLUGIN_GROUP = "slipstream.environments"

log = logging.getLogger(__name__)

ENVIRONMENTS: dict[str, type[Environment[Any]]] = {}
_CLOSERS: list[Callable[[], Awaitable[None]]] = []

E = TypeVar("E", bound=type[Environment[Any]])


class EnvError(ValueError):
    """An unknown environment, an unknown option, or an option of the wrong type or value."""


def on_close(closer: Callable[[], Awaitable[None]]) -> None:
    """Have `close_envs` await `closer` (once, however often it is registered)."""
    if closer not in _CLOSERS:
        _CLOSERS.append(closer)


async def close_envs() -> None:
    """Close what environments hold open for the process (`on_close`), in the order registered."""
    for closer in list(_CLOSERS):
        await closer()


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
    """Names of the environments that generate tasks (every one but traffic scorers), installed
    plugins included; a plugin that fails to import is left out here (`get_env` names its error)."""
    for name in plugins():
        if name not in ENVIRONMENTS:
            try:
                _load_plugin(name)
            except EnvError as exc:
                log.warning("%s", exc)
    return sorted(name for name, cls in ENVIRONMENTS.items() if cls.has_tasks)


def available() -> list[str]:
    """Every environment name `get_env` may take: the registered ones and the installed plugins'."""
    return sorted(set(ENVIRONMENTS) | set(plugins()))


def plugins() -> dict[str, str]:
    """The installed plugins' environments, {name: "distribution (module:object)"}, none imported."""
    return {name: _origin(ep) for name, ep in _plugin_entry_points().items()}


def _plugin_entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    found: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        seen = found.get(ep.name)
        # One distribution can be on the path twice (an editable install); two that differ clash.
        if seen is not None and seen.value != ep.value:
            raise EnvError(f"environment {ep.name!r} is claimed by two plugins: {_origin(seen)} and {_origin(ep)}")
        found[ep.name] = ep
    return found


def _origin(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return f"{dist.name if dist is not None else '?'} ({ep.value})"


def _load_plugin(name: str) -> type[Environment[Any]]:
    """Import the plugin that provides `name` and return its registered class."""
    ep = _plugin_entry_points().get(name)
    if ep is None:
        raise EnvError(f"unknown environment {name!r}; known: {', '.join(available()) or '(none)'}")
    if not _NAME.fullmatch(name):
        raise EnvError(f"plugin {_origin(ep)}: environment name {name!r} must match {_NAME.pattern}")
    try:
        obj = ep.load()
    except Exception as exc:  # any import-time failure of third-party code is the plugin's error
        raise EnvError(
            f"environment {name!r}: its plugin {_origin(ep)} failed to import: {type(exc).__name__}: {exc}"
        ) from exc
    if inspect.isclass(obj) and issubclass(obj, Environment) and name not in ENVIRONMENTS:
        if obj.name and obj.name != name:
            raise EnvError(
                f"plugin {_origin(ep)}: entry point {name!r} names {obj.__qualname__}, "
                f"registered as {obj.name!r}; the two names must agree"
            )
        register(name)(obj)
    cls = ENVIRONMENTS.get(name)
    if cls is None:
        raise EnvError(
            f"plugin {_origin(ep)}: loading it registered no environment {name!r} "
            "(point the entry point at an Environment subclass, or register it under that name)"
        )
    return cls


def get_env(name: str, /, **options: Any) -> Environment[Any]:
    """An instance of environment `name` with `options` (each default when not given)."""
    return _lookup(name)(parse_options(name, options))


def environment_class(name: str) -> type[Environment[Any]]:
    """The class registered (or installed as a plugin) under `name`; `EnvError` naming what exists."""
    return _lookup(name)


def _lookup(name: str) -> type[Environment[Any]]:
    cls = ENVIRONMENTS.get(name)
    return cls if cls is not None else _load_plugin(name)
