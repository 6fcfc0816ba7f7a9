"""Tool calls: the malformed-call corpus, execution classes and concurrency, the builtin tools.

Corpus: each case is model text, the kind it is tagged with, and the exact error text the model
will see as its observation; `tally` must count the tag.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from slipstream.toolcalls import (
    HERMES_SYNTAX,
    TAG_SYNTAX,
    LocalTransport,
    MalformedCall,
    Tool,
    ToolCall,
    ToolDefinitionError,
    ToolInputError,
    ToolRegistry,
    calculator,
    evaluate,
    execute,
    lookup,
    parse_calls,
    tally,
    tool_event,
)

pytestmark = pytest.mark.unit

REG = ToolRegistry([calculator(), lookup({"paris": "France"})])
EXAMPLE = '<tool>{"name": ..., "args": {...}}</tool>'


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    kind: str
    error: str


CORPUS = [
    Case("unclosed", '<tool>{"name": "calculator", "args": {"expression": "1"}}', "bad_tags",
         f"error: <tool> was not closed with </tool>; write a tool call as {EXAMPLE}"),
    Case("unopened", '{"name": "calculator", "args": {}}</tool>', "bad_tags",
         f"error: found </tool> without <tool>; write a tool call as {EXAMPLE}"),
    Case("trailing-comma", '<tool>{"name": "calculator", "args": {"expression": "1"},}</tool>', "bad_json",
         f"error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at position 51); "
         f"write it as {EXAMPLE}"),
    Case("single-quotes", "<tool>{'name': 'calculator'}</tool>", "bad_json",
         f"error: the tool call is not valid JSON (Expecting property name enclosed in double quotes at position 1); "
         f"write it as {EXAMPLE}"),
    Case("empty", "<tool></tool>", "bad_json",
         f"error: the tool call is not valid JSON (Expecting value at position 0); write it as {EXAMPLE}"),
    Case("list", '<tool>["calculator", "1+1"]</tool>', "bad_shape",
         'error: a tool call must be a JSON object with a string "name" and an object "args" (got a JSON list); '
         f"write it as {EXAMPLE}"),
    Case("no-name", '<tool>{"args": {"expression": "1"}}</tool>', "bad_shape",
         'error: a tool call must be a JSON object with a string "name" and an object "args" '
         f'(the "name" field is missing or not a string); write it as {EXAMPLE}'),
    Case("args-string", '<tool>{"name": "calculator", "args": "1+1"}</tool>', "bad_shape",
         'error: a tool call must be a JSON object with a string "name" and an object "args" '
         f'("args" must be a JSON object, got "1+1"); write it as {EXAMPLE}'),
    Case("openai-key", '<tool>{"name": "calculator", "arguments": {"expression": "1"}}</tool>', "bad_shape",
         'error: a tool call must be a JSON object with a string "name" and an object "args" '
         f"(unexpected field(s) 'arguments'); write it as {EXAMPLE}"),
    Case("unknown-tool", '<tool>{"name": "calc", "args": {"expression": "1"}}</tool>', "unknown_tool",
         "error: unknown tool 'calc'; available tools: calculator, lookup"),
    Case("missing-arg", '<tool>{"name": "calculator", "args": {}}</tool>', "bad_arguments",
         "error: invalid arguments for calculator: 'expression' is a required property"),
    Case("wrong-type", '<tool>{"name": "calculator", "args": {"expression": 5}}</tool>', "bad_arguments",
         "error: invalid arguments for calculator: 5 is not of type 'string' (at expression)"),
    Case("extra-arg", '<tool>{"name": "lookup", "args": {"key": "paris", "k": 1}}</tool>', "bad_arguments",
         "error: invalid arguments for lookup: Additional properties are not allowed ('k' was unexpected)"),
    Case("empty-key", '<tool>{"name": "lookup", "args": {"key": ""}}</tool>', "bad_arguments",
         "error: invalid arguments for lookup: '' should be non-empty (at key)"),
]  # fmt: skip


@pytest.mark.parametrize("case", CORPUS, ids=[c.id for c in CORPUS])
async def test_malformed_corpus(case: Case) -> None:
    turn = parse_calls("Let me see. " + case.text, REG, TAG_SYNTAX, call_id_prefix="e1-t0")
    assert turn.calls == ()
    assert len(turn.malformed) == 1
    bad = turn.malformed[0]
    assert (bad.kind, bad.error) == (case.kind, case.error)
    assert bad.id == "e1-t0-0"
    results = await execute(turn.items, LocalTransport(REG))
    assert [(r.outcome, r.text) for r in results] == [("invalid_tool_call", case.error)]
    assert tally(results) == {"invalid_tool_call": 1, f"invalid_tool_call/{case.kind}": 1}


def test_the_corpus_covers_every_parse_time_kind() -> None:
    assert {c.kind for c in CORPUS} == {"bad_tags", "bad_json", "bad_shape", "unknown_tool", "bad_arguments"}


def test_hermes_syntax_names_its_own_keys_in_errors() -> None:
    turn = parse_calls('<tool_call>{"name": "calculator", "args": {}}</tool_call>', REG, HERMES_SYNTAX)
    assert turn.malformed[0].error == (
        'error: a tool call must be a JSON object with a string "name" and an object "arguments" '
        '(unexpected field(s) \'args\'); write it as <tool_call>{"name": ..., "arguments": {...}}</tool_call>'
    )


def test_good_and_bad_calls_keep_text_order_and_ids() -> None:
    text = (
        'A <tool>{"name": "calculator", "args": {"expression": "6*7"}}</tool> B <tool>{bad}</tool> C '
        '<tool>{"name": "lookup", "args": {"key": "paris"}}</tool><tool>{"name": "x"'
    )
    turn = parse_calls(text, REG, TAG_SYNTAX, call_id_prefix="p")
    assert [(i.id, type(i).__name__) for i in turn.items] == [
        ("p-0", "ToolCall"),
        ("p-1", "MalformedCall"),
        ("p-2", "ToolCall"),
        ("p-3", "MalformedCall"),
    ]
    assert [m.kind for m in turn.malformed] == ["bad_json", "bad_tags"]
    assert turn.content == "A  B  C"


async def test_execution_classifies_each_outcome_and_keeps_order() -> None:
    async def crash(x: int) -> str:
        raise RuntimeError("backend bug")

    async def sulk(x: int) -> str:
        await asyncio.sleep(5)
        return "late"

    async def picky(x: int) -> str:
        raise ToolInputError("x must be even")

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    reg = ToolRegistry(
        [
            calculator(),
            Tool(name="crash", description="", parameters=schema, fn=crash),
            Tool(name="sulk", description="", parameters=schema, fn=sulk, timeout_s=0.05),
            Tool(name="picky", description="", parameters=schema, fn=picky),
        ]
    )
    items: list[ToolCall | MalformedCall] = [
        ToolCall(id="a", name="calculator", arguments={"expression": "(12 + 7) * 3"}),
        ToolCall(id="b", name="crash", arguments={"x": 1}),
        ToolCall(id="c", name="sulk", arguments={"x": 1}),
        ToolCall(id="d", name="picky", arguments={"x": 3}),
        ToolCall(id="e", name="calculator", arguments={"expression": "1/0"}),
        ToolCall(id="f", name="nope", arguments={}),
        ToolCall(id="g", name="calculator", arguments={"expr": "1"}),
    ]
    results = await execute(items, LocalTransport(reg))
    assert [(r.call_id, r.outcome, r.kind, r.text) for r in results] == [
        ("a", "ok", "", "57"),
        ("b", "infra_error", "tool_crashed", "error: tool crash failed: RuntimeError"),
        ("c", "infra_error", "timeout", "error: tool sulk timed out after 0.05 s"),
        ("d", "invalid_tool_call", "bad_arguments", "error: invalid arguments for picky: x must be even"),
        ("e", "invalid_tool_call", "bad_arguments", "error: invalid arguments for calculator: division by zero"),
        ("f", "invalid_tool_call", "unknown_tool", "error: unknown tool 'nope'"),
        ("g", "invalid_tool_call", "bad_arguments",
         "error: invalid arguments for calculator: 'expression' is a required property"),
    ]  # fmt: skip
    assert tally(results) == {
        "ok": 1,
        "infra_error": 2,
        "infra_error/tool_crashed": 1,
        "infra_error/timeout": 1,
        "invalid_tool_call": 4,
        "invalid_tool_call/bad_arguments": 3,
        "invalid_tool_call/unknown_tool": 1,
    }


async def test_calls_of_one_turn_run_concurrently() -> None:
    # Each call waits until all four are running at once: a sequential executor would time out.
    started = 0
    all_in = asyncio.Event()

    async def meet(i: int) -> str:
        nonlocal started
        started += 1
        if started == 4:
            all_in.set()
        await all_in.wait()
        return str(i)

    schema = {"type": "object", "properties": {"i": {"type": "integer"}}, "required": ["i"]}
    reg = ToolRegistry([Tool(name="meet", description="", parameters=schema, fn=meet, timeout_s=0.5)])
    calls = [ToolCall(id=str(i), name="meet", arguments={"i": i}) for i in range(4)]
    results = await execute(calls, LocalTransport(reg))
    assert [(r.outcome, r.text) for r in results] == [("ok", "0"), ("ok", "1"), ("ok", "2"), ("ok", "3")]


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2+3", 5), ("(12 + 7) * 3", 57), ("7/2", 3.5), ("-2**3", -8), ("17 // 5", 3), ("17 % 5", 2), ("1.5*2", 3.0)],
)
def test_calculator_values(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "error"),
    [
        ("2+*3", "cannot parse '2+*3' as arithmetic"),
        ("__import__('os')", "only numbers and + - * / // % ** ( ) are allowed in \"__import__('os')\""),
        ("9**9**9", "exponent too large"),
        ("1/0", "division by zero"),
        ("1" * 201, "expression longer than 200 characters"),
    ],
)
def test_calculator_rejects_with_a_reason(expression: str, error: str) -> None:
    with pytest.raises(ToolInputError) as exc:
        evaluate(expression)
    assert str(exc.value) == error


async def test_lookup_answers_and_reports_missing_keys() -> None:
    reg = ToolRegistry([lookup({"paris": "France"})])
    t = LocalTransport(reg)
    found = await t.invoke(ToolCall(id="1", name="lookup", arguments={"key": " paris "}))
    missing = await t.invoke(ToolCall(id="2", name="lookup", arguments={"key": "oslo"}))
    assert (found.outcome, found.text) == ("ok", "France")
    assert (missing.outcome, missing.text) == ("ok", "no entry for 'oslo'")


def test_tool_definitions_are_checked() -> None:
    obj = {"type": "object"}
    with pytest.raises(ToolDefinitionError, match="must match"):
        Tool(name="Bad Name", description="", parameters=obj)
    with pytest.raises(ToolDefinitionError, match="type 'object'"):
        Tool(name="t", description="", parameters={"type": "string"})
    with pytest.raises(ToolDefinitionError, match="invalid JSON schema"):
        Tool(name="t", description="", parameters={"type": "object", "properties": {"x": {"type": "nope"}}})
    with pytest.raises(ToolDefinitionError, match="registered twice"):
        ToolRegistry([calculator(), calculator()])


async def test_tool_events_log_what_the_model_wrote_and_what_it_saw() -> None:
    text = '<tool>{"name": "calculator", "args": {"expression": "2 + 3"}}</tool><tool>{"name": "calc"}</tool>'
    turn = parse_calls(text, REG, TAG_SYNTAX, call_id_prefix="e1-t4")
    results = await execute(turn.items, LocalTransport(REG))
    events = [tool_event(i, r, sample_id="s0", turn=4) for i, r in zip(turn.items, results, strict=True)]
    assert [(e.call_id, e.name, e.arguments, e.status, e.result, e.error, e.info) for e in events] == [
        ("e1-t4-0", "calculator", '<tool>{"name": "calculator", "args": {"expression": "2 + 3"}}</tool>', "ok", "5",
         "", {}),
        ("e1-t4-1", "calc", '<tool>{"name": "calc"}</tool>', "invalid_tool_call", "",
         "error: unknown tool 'calc'; available tools: calculator, lookup", {"kind": "unknown_tool"}),
    ]  # fmt: skip
    assert {(e.sample_id, e.turn) for e in events} == {("s0", 4)}
