"""From model text to tool calls: well-formed calls and classified malformed ones, in text order.

A call is a JSON object between an opening and a closing tag; a `CallSyntax` names the tags and
the key that holds the arguments (`<tool>{"name": .., "args": {..}}</tool>` for byte-level
models, `<tool_call>{"name": .., "arguments": {..}}</tool_call>` for ChatML models). Every
malformed call gets an error text written for the model: it says what was wrong and what the
right form is, because the model reads it as its next observation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from slipstream.toolcalls.calls import MalformedCall, ToolCall
from slipstream.toolcalls.tool import ToolRegistry


@dataclass(frozen=True)
class CallSyntax:
    """How calls are written in model text."""

    open_tag: str
    close_tag: str
    args_key: str

    @property
    def example(self) -> str:
        return f'{self.open_tag}{{"name": ..., "{self.args_key}": {{...}}}}{self.close_tag}'


TAG_SYNTAX = CallSyntax(open_tag="<tool>", close_tag="</tool>", args_key="args")
HERMES_SYNTAX = CallSyntax(open_tag="<tool_call>", close_tag="</tool_call>", args_key="arguments")


@dataclass(frozen=True)
class ParsedTurn:
    """One assistant turn: the text outside calls, and every call in the order it was written."""

    content: str
    items: tuple[ToolCall | MalformedCall, ...]

    @property
    def calls(self) -> tuple[ToolCall, ...]:
        return tuple(i for i in self.items if isinstance(i, ToolCall))

    @property
    def malformed(self) -> tuple[MalformedCall, ...]:
        return tuple(i for i in self.items if isinstance(i, MalformedCall))


def _short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def parse_calls(text: str, registry: ToolRegistry, syntax: CallSyntax, *, call_id_prefix: str = "call") -> ParsedTurn:
    """Split `text` into content and calls. Call ids are `<prefix>-<n>`, n counting from 0 in text order.

    Give a prefix unique per episode and turn: a tool service deduplicates retried calls by id.
    """
    items: list[ToolCall | MalformedCall] = []
    outside: list[str] = []
    pos = 0

    def next_id() -> str:
        return f"{call_id_prefix}-{len(items)}"

    while True:
        start = text.find(syntax.open_tag, pos)
        stray = text.find(syntax.close_tag, pos)
        if stray != -1 and (start == -1 or stray < start):
            # A closing tag with no opening tag before it: the payload is whatever precedes it.
            outside.append(text[pos:stray])
            items.append(
                MalformedCall(
                    id=next_id(),
                    kind="bad_tags",
                    error=f"error: found {syntax.close_tag} without {syntax.open_tag}; write a tool call as "
                    f"{syntax.example}",
                    raw=text[pos : stray + len(syntax.close_tag)],
                )
            )
            pos = stray + len(syntax.close_tag)
            continue
        if start == -1:
            outside.append(text[pos:])
            break
        outside.append(text[pos:start])
        body_at = start + len(syntax.open_tag)
        end = text.find(syntax.close_tag, body_at)
        nested = text.find(syntax.open_tag, body_at)
        if end == -1 or (nested != -1 and nested < end):
            stop = nested if nested != -1 else len(text)
            items.append(
                MalformedCall(
                    id=next_id(),
                    kind="bad_tags",
                    error=f"error: {syntax.open_tag} was not closed with {syntax.close_tag}; write a tool call as "
                    f"{syntax.example}",
                    raw=text[start:stop],
                )
            )
            pos = stop
            continue
        items.append(
            _parse_one(text[body_at:end], text[start : end + len(syntax.close_tag)], next_id(), registry, syntax)
        )
        pos = end + len(syntax.close_tag)
    return ParsedTurn(content="".join(outside).strip(), items=tuple(items))


def _parse_one(
    body: str, raw: str, call_id: str, registry: ToolRegistry, syntax: CallSyntax
) -> ToolCall | MalformedCall:
    try:
        obj: Any = json.loads(body)
    except json.JSONDecodeError as exc:
        return MalformedCall(
            id=call_id,
            kind="bad_json",
            error=f"error: the tool call is not valid JSON ({exc.msg} at position {exc.pos}); write it as "
            f"{syntax.example}",
            raw=raw,
        )
    key = syntax.args_key
    name = obj.get("name") if isinstance(obj, dict) else None
    shape_error = None
    if not isinstance(obj, dict):
        shape_error = f"got a JSON {type(obj).__name__}"
    elif not isinstance(name, str) or not name:
        shape_error = 'the "name" field is missing or not a string'
    elif not isinstance(obj.get(key, {}), dict):
        shape_error = f'"{key}" must be a JSON object, got {_short(json.dumps(obj[key]))}'
    elif extra := sorted(set(obj) - {"name", key}):
        shape_error = f"unexpected field(s) {', '.join(repr(k) for k in extra)}"
    if shape_error is not None:
        return MalformedCall(
            id=call_id,
            kind="bad_shape",
            error=f'error: a tool call must be a JSON object with a string "name" and an object "{key}" '
            f"({shape_error}); write it as {syntax.example}",
            raw=raw,
            name=name if isinstance(name, str) else None,
        )
    assert isinstance(obj, dict) and isinstance(name, str)
    tool = registry.get(name)
    if tool is None:
        known = ", ".join(registry.names) or "(none)"
        return MalformedCall(
            id=call_id,
            kind="unknown_tool",
            error=f"error: unknown tool {_short(name, 40)!r}; available tools: {known}",
            raw=raw,
            name=name,
        )
    args = obj.get(key, {})
    problem = tool.argument_error(args, from_model=True)
    if problem is not None:
        return MalformedCall(
            id=call_id,
            kind="bad_arguments",
            error=f"error: invalid arguments for {name}: {problem}",
            raw=raw,
            name=name,
        )
    return ToolCall(id=call_id, name=name, arguments=args, raw=raw)
