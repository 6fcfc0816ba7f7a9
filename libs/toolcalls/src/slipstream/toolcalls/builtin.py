"""Small deterministic tools for environments and tests: a calculator, a key-value lookup, a wait.

They are pure functions of their arguments (and of the table a lookup is built with), so an
episode replays identically and a retried call returns the same answer on any replica.
"""

from __future__ import annotations

import ast
import asyncio
import operator
from collections.abc import Callable, Mapping
from typing import Any

from slipstream.toolcalls.tool import Tool, ToolInputError

_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 10**30


def evaluate(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); ToolInputError otherwise."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ToolInputError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ToolInputError(f"cannot parse {expression!r} as arithmetic") from None

    def ev(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (abs(right) > 64 or abs(left) > 10**6):
                raise ToolInputError("exponent too large")
            try:
                value = _BINARY[type(node.op)](left, right)
            except ZeroDivisionError:
                raise ToolInputError("division by zero") from None
            if abs(value) > MAX_MAGNITUDE:
                raise ToolInputError("result too large")
            return value
        raise ToolInputError(f"only numbers and + - * / // % ** ( ) are allowed in {expression!r}")

    return ev(tree.body)


def format_number(value: int | float) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value) if isinstance(value, int) else f"{value:.12g}"


def calculator(name: str = "calculator", timeout_s: float = 2.0) -> Tool:
    async def run(expression: str) -> str:
        return format_number(evaluate(expression))

    return Tool(
        name=name,
        description="Evaluate an arithmetic expression with + - * / // % ** and parentheses.",
        parameters={
            "type": "object",
            "properties": {"expression": {"type": "string", "description": "for example (12 + 7) * 3"}},
            "required": ["expression"],
            "additionalProperties": False,
        },
        fn=run,
        timeout_s=timeout_s,
    )


def lookup(table: Mapping[str, str], name: str = "lookup", timeout_s: float = 2.0, description: str = "") -> Tool:
    """A key-value lookup over a fixed table. A missing key is an answer ("no entry"), not an error."""
    frozen = dict(table)

    async def run(key: str) -> str:
        value = frozen.get(key.strip())
        return value if value is not None else f"no entry for {key.strip()!r}"

    return Tool(
        name=name,
        description=description or "Look up the value stored under a key.",
        parameters={
            "type": "object",
            "properties": {"key": {"type": "string", "minLength": 1}},
            "required": ["key"],
            "additionalProperties": False,
        },
        fn=run,
        timeout_s=timeout_s,
    )


def wait(name: str = "wait", timeout_s: float = 5.0) -> Tool:
    """Sleeps `ms` milliseconds, then echoes `text`: a stand-in for a slow backend in tests."""

    async def run(ms: int, text: str = "") -> str:
        await asyncio.sleep(ms / 1000)
        return text

    return Tool(
        name=name,
        description="Wait ms milliseconds, then return text.",
        parameters={
            "type": "object",
            "properties": {"ms": {"type": "integer", "minimum": 0, "maximum": 60000}, "text": {"type": "string"}},
            "required": ["ms"],
            "additionalProperties": False,
        },
        fn=run,
        timeout_s=timeout_s,
    )
