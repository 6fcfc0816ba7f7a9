"""What a turn's tool calls become: parsed calls, malformed calls and classified results.

Three outcomes, decided once here and used everywhere (harness, learner metrics, services):

- `ok`: the tool ran; its text is the observation.
- `invalid_tool_call`: the model's fault (bad tags, bad JSON, wrong shape, unknown tool, arguments
  that break the schema or that the tool rejects). The error text is shown to the model as the
  observation, the call is tagged and counted, and a configurable penalty may apply.
- `infra_error`: never the model's fault (backend down, no responder, timeout, a tool that
  crashed). The caller retries or masks the episode; it must not be scored against the model.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from slipstream.schemas.episode import ToolEvent

Outcome = Literal["ok", "invalid_tool_call", "infra_error"]
OUTCOMES: tuple[Outcome, ...] = ("ok", "invalid_tool_call", "infra_error")

MalformedKind = Literal["bad_tags", "bad_json", "bad_shape", "unknown_tool", "bad_arguments"]
"""Why a call is the model's fault: `bad_tags` (an opening tag without its closing tag or the
reverse), `bad_json` (the payload does not parse), `bad_shape` (not an object with a string name
and an object of arguments), `unknown_tool`, `bad_arguments` (schema violation, or the tool
raised `ToolInputError`)."""
MALFORMED_KINDS: tuple[MalformedKind, ...] = ("bad_tags", "bad_json", "bad_shape", "unknown_tool", "bad_arguments")

InfraKind = Literal["timeout", "unavailable", "tool_crashed"]
"""Why a call failed without the model being at fault: the tool ran past its timeout, no backend
answered (after the transport's retries), or the implementation raised an unexpected exception."""
INFRA_KINDS: tuple[InfraKind, ...] = ("timeout", "unavailable", "tool_crashed")

IN_PROCESS = "local"
"""`ToolResult.served_by` of a call run in the caller's process (`LocalTransport`)."""


@dataclass(frozen=True)
class ToolCall:
    """A well-formed call: a known tool and arguments that satisfy its schema."""

    id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    raw: str = ""
    """The call as the model wrote it, tags included (empty for calls built in code)."""


@dataclass(frozen=True)
class MalformedCall:
    """A call the model got wrong; `error` is the observation text the model will see."""

    id: str
    kind: MalformedKind
    error: str
    raw: str
    name: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The classified result of one call. `text` is what the model sees (for every outcome)."""

    call_id: str
    name: str | None
    outcome: Outcome
    text: str
    kind: str = ""
    elapsed_s: float = 0.0
    attempts: int = 1
    served_by: str = ""

    @property
    def is_error(self) -> bool:
        return self.outcome != "ok"


def with_hidden(call: ToolCall, values: Mapping[str, Any], *, accepts: Iterable[str] | None = None) -> ToolCall:
    """`call` with the harness's hidden arguments (names starting with `_`) set to `values`.

    Hidden arguments already in the call are dropped first: only the harness sets them. With
    `accepts` (a tool's `hidden` names), values the tool does not declare are left out, so one
    set of values (exclusion, budget, query) can be offered to every call of a turn.
    """
    bad = sorted(k for k in values if not k.startswith("_"))
    if bad:
        raise ValueError(f"hidden argument names must start with '_': {bad}")
    allowed = None if accepts is None else set(accepts)
    args = {k: v for k, v in call.arguments.items() if not k.startswith("_")}
    args.update({k: v for k, v in values.items() if allowed is None or k in allowed})
    return ToolCall(id=call.id, name=call.name, arguments=args, raw=call.raw)


def invalid_result(call: MalformedCall) -> ToolResult:
    """The result of a call that is never executed because parsing already found it malformed."""
    return ToolResult(call_id=call.id, name=call.name, outcome="invalid_tool_call", text=call.error, kind=call.kind)


def tool_event(item: ToolCall | MalformedCall, result: ToolResult, *, sample_id: str, turn: int) -> ToolEvent:
    """The episode's log entry for one call (`Episode.tool_log`): what the scorer sees."""
    if isinstance(item, ToolCall):
        arguments = item.raw or json.dumps(dict(item.arguments), ensure_ascii=False)
    else:
        arguments = item.raw
    failed = result.outcome != "ok"
    info = {"kind": result.kind} if result.kind else {}
    if result.served_by and result.served_by != IN_PROCESS:
        info["served_by"] = result.served_by  # the tool-service replica that answered
    if result.attempts != 1 or "served_by" in info:
        # Sends of a remote call (retries are not events: one call, one event, however many sends).
        info["attempts"] = str(result.attempts)
    return ToolEvent(
        sample_id=sample_id,
        turn=turn,
        call_id=result.call_id,
        name=result.name or "",
        arguments=arguments,
        status=result.outcome,
        result="" if failed else result.text,
        error=result.text if failed else "",
        latency_s=result.elapsed_s,
        info=info,
    )


def tally(results: Iterable[ToolResult]) -> Counter[str]:
    """Counts by outcome and by `outcome/kind`: `{"ok": 3, "invalid_tool_call": 1, "invalid_tool_call/bad_json": 1}`."""
    c: Counter[str] = Counter()
    for r in results:
        c[r.outcome] += 1
        if r.kind:
            c[f"{r.outcome}/{r.kind}"] += 1
    return c
