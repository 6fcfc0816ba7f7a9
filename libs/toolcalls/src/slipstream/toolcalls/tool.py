"""A tool and the registry of tools an episode may call.

A `Tool` is a name, a description, a JSON schema for its arguments (an object schema, checked
when the tool is built), an async implementation and a timeout. The registry is what the parser
validates calls against and what the renderers describe to the model; the implementation may
run in-process or behind a service (the transport decides, see `execution.py`).

Hidden arguments: a property whose name starts with `_` (`HIDDEN_PREFIX`) belongs to the
harness, not the model. It is validated and passed to `fn` like any other argument, but it is
never shown (`spec()`, `shown_parameters()`), it may not be required, and a call the model wrote
with one is malformed (`argument_error(..., from_model=True)`, what the parser uses). The harness
sets them after parsing with `with_hidden(call, values)`; they then travel with the call, over
NATS too, so a replica answers exactly as in-process (the search tools' seen-chunk exclusion
and token budget ride here).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jsonschema
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match

_NAME = re.compile(r"[a-z][a-z0-9_]*")
HIDDEN_PREFIX = "_"

ToolFn = Callable[..., Awaitable[Any]]


class ToolDefinitionError(ValueError):
    """A tool that cannot be registered: bad name, bad schema, duplicate name."""


class ToolInputError(Exception):
    """Raised by an implementation when well-typed arguments still make no sense (`1/0`, `2+*3`).

    It is the model's fault: the call is classified `invalid_tool_call` (kind `bad_arguments`) and
    the message is what the model sees. Any other exception from an implementation is a tool bug
    and is classified as an infrastructure error, never the model's fault.
    """


@dataclass(frozen=True)
class Tool:
    """One callable tool. `fn` is called with the validated arguments as keyword arguments."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: ToolFn | None = None
    timeout_s: float = 10.0
    _validator: Draft202012Validator = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ToolDefinitionError(
                f"tool name {self.name!r} must match {_NAME.pattern} (it is a NATS subject token)"
            )
        if self.parameters.get("type") != "object":
            raise ToolDefinitionError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object'")
        try:
            Draft202012Validator.check_schema(self.parameters)
        except jsonschema.SchemaError as exc:
            raise ToolDefinitionError(f"tool {self.name!r}: invalid JSON schema: {exc.message}") from exc
        if not self.timeout_s > 0:
            raise ToolDefinitionError(f"tool {self.name!r}: timeout_s must be > 0, got {self.timeout_s}")
        required_hidden = [r for r in self.parameters.get("required", ()) if str(r).startswith(HIDDEN_PREFIX)]
        if required_hidden:
            raise ToolDefinitionError(
                f"tool {self.name!r}: hidden arguments {required_hidden} cannot be required (the model never sees them)"
            )
        object.__setattr__(self, "_validator", Draft202012Validator(self.parameters))

    @property
    def hidden(self) -> tuple[str, ...]:
        """The names of the harness's hidden arguments, in schema order."""
        return tuple(k for k in self.parameters.get("properties", {}) if k.startswith(HIDDEN_PREFIX))

    def shown_parameters(self) -> dict[str, Any]:
        """The schema the model is shown: `parameters` without the hidden arguments."""
        shown = dict(self.parameters)
        props = shown.get("properties")
        if isinstance(props, Mapping) and any(k.startswith(HIDDEN_PREFIX) for k in props):
            shown["properties"] = {k: v for k, v in props.items() if not k.startswith(HIDDEN_PREFIX)}
        return shown

    def argument_error(self, args: Mapping[str, Any], *, from_model: bool = False) -> str | None:
        """None when `args` satisfy the schema, else one readable sentence naming the first problem.

        `from_model`: the arguments are the model's own, so a hidden argument among them is an
        error named as an unknown one (the model was never shown it).
        """
        if from_model:
            hidden = sorted(k for k in args if k.startswith(HIDDEN_PREFIX))
            if hidden:
                return f"unexpected argument(s) {', '.join(repr(k) for k in hidden)}"
        err = best_match(self._validator.iter_errors(dict(args)))
        if err is None:
            return None
        where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err.absolute_path)
        return f"{err.message}" + (f" (at {where.lstrip('.')})" if where else "")

    def spec(self) -> dict[str, Any]:
        """The OpenAI / Hugging Face function description: what chat templates put in `tools`."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.shown_parameters()},
        }


class ToolRegistry:
    """Tools by name, in registration order (the order renderers list them)."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for t in tools:
            self.add(t)

    def add(self, tool: Tool) -> None:
        if tool.name in self._tools:
            raise ToolDefinitionError(f"tool {tool.name!r} is registered twice")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._tools)

    def specs(self) -> list[dict[str, Any]]:
        return [t.spec() for t in self._tools.values()]

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())

    def __len__(self) -> int:
        return len(self._tools)
