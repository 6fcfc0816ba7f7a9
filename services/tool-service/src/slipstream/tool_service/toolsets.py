"""Tool sets: the named groups of tools a replica serves (`[serve] sets`).

`calc` and `wait` are the built-in deterministic tools of libs/toolcalls (option: `timeout_s`);
`search` is search_corpus / grep_corpus / read_document over a hybrid index loaded from the
object store (options in `search.py`; it takes precedence over an environment of that name: the
search environment's tools are these, served from the stored index), or, with the single option
`env` (a table of the search environment's options), those of the environment itself: its
generated corpus behind its `backend` (the CPU plan's `bm25`), as the workers build it. `code` is
the replica's sandbox host (sandboxes.py: `sandbox_create` and this replica's routed tool), made
by the service, which owns its reaper and its drain. Any other
name is an environment from the registry whose tools are served as the environment itself
defines them (`lookup` -> its `get`), built with the same options as the workers' copy, so a call
answers the same on a replica as in-process.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from slipstream.envs import EnvError, get_env
from slipstream.envs.registry import available
from slipstream.store import StoreConfig
from slipstream.tool_service.search import SearchSetError, search_toolset
from slipstream.toolcalls import Tool, ToolRegistry, calculator, wait

BUILTIN: dict[str, Callable[..., Tool]] = {"calc": calculator, "wait": wait}


class ToolSetError(ValueError):
    """A tool set that cannot be served: unknown name, an environment without tools, bad options, a clash."""


def tools_of(name: str, options: Mapping[str, Any], *, store: StoreConfig | None = None) -> list[Tool]:
    if name in BUILTIN:
        unknown = set(options) - {"timeout_s"}
        if unknown:
            raise ToolSetError(f"tool set {name!r} takes only the option timeout_s, got {sorted(unknown)}")
        timeout_s = options.get("timeout_s")
        if timeout_s is None:
            return [BUILTIN[name]()]
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or timeout_s <= 0:
            raise ToolSetError(f"tool set {name!r}: timeout_s must be a number > 0, got {timeout_s!r}")
        return [BUILTIN[name](timeout_s=float(timeout_s))]
    if name == "search" and "env" in options:
        if set(options) != {"env"} or not isinstance(options["env"], Mapping):
            raise ToolSetError(
                "tool set 'search' with option env takes that one option, a table of the search "
                f"environment's options; got options {sorted(options)}"
            )
        tools, env = env_tools("search", options["env"])
        try:
            env.backend()  # type: ignore[attr-defined]  # built now: a bad backend fails the replica's start
        except (LookupError, ValueError) as exc:
            raise ToolSetError(f"tool set 'search' (env): its backend cannot be built: {exc}") from exc
        return tools
    if name == "search":
        try:
            return search_toolset(options, store=store)
        except SearchSetError as exc:
            raise ToolSetError(str(exc)) from exc
    if name not in available():
        # available(): the registered environments and the installed plugins' (imported when named).
        known = ", ".join([*BUILTIN, "search", *available()])
        raise ToolSetError(f"unknown tool set {name!r}; known: {known}")
    return env_tools(name, options)[0]


def env_tools(name: str, options: Mapping[str, Any]) -> tuple[list[Tool], Any]:
    """The tools of environment `name` built with `options` (what its workers call in-process), and the env."""
    try:
        env = get_env(name, **options)
    except EnvError as exc:
        raise ToolSetError(f"tool set {name!r}: {exc}") from exc
    registry = getattr(env, "registry", None)
    if not isinstance(registry, ToolRegistry) or not len(registry):
        raise ToolSetError(f"environment {name!r} has no tools to serve")
    return list(registry), env


def build_registry(
    sets: list[str],
    options: Mapping[str, Mapping[str, Any]],
    *,
    store: StoreConfig | None = None,
    made: Mapping[str, list[Tool]] | None = None,
) -> ToolRegistry:
    """Every tool of every set, checked: at least one set, no tool served twice.

    `store` is the replica's `[store]`: where a set that loads data (search) finds it unless its
    options name a store of their own. `made` holds the tools of sets the service built itself
    (`code`: they share a sandbox host with the service's reaper and drain).
    """
    if not sets:
        raise ToolSetError("[serve] sets is empty: a replica must serve at least one tool set")
    unused = set(options) - set(sets)
    if unused:
        raise ToolSetError(f"[serve] options names tool sets that are not served: {sorted(unused)}")
    registry = ToolRegistry()
    owner: dict[str, str] = {}
    made = made or {}
    for name in sets:
        if name == "code" and name not in made:
            raise ToolSetError("tool set 'code' is made by the service (its sandbox host), not by build_registry")
        tools = made[name] if name in made else tools_of(name, options.get(name, {}), store=store)
        for tool in tools:
            if tool.name in owner:
                raise ToolSetError(f"tool {tool.name!r} is in both tool sets {owner[tool.name]!r} and {name!r}")
            owner[tool.name] = name
            registry.add(tool)
    return registry
