"""Slipstream tool calls, the tools an agent calls: registry, call parsing, classified execution, renderers.

```python
from slipstream.toolcalls import LocalTransport, ToolRegistry, calculator, execute, renderer_for

registry = ToolRegistry([calculator()])
r = renderer_for("smollm2")            # or "tags" for byte-level models, "qwen2.5"
prompt = r.render(messages, tools=registry)
turn = r.parse(completion, registry, call_id_prefix="ep1-t0")
results = await execute(turn.items, LocalTransport(registry))   # ok / invalid_tool_call / infra_error
suffix = r.bridge(messages, completion, r.result_messages(results), tools=registry)  # None: start a new sample
```
"""

from slipstream.toolcalls import chatml as _chatml  # noqa: F401  (registers smollm2, qwen2.5)
from slipstream.toolcalls import tags as _tags  # noqa: F401  (registers tags)
from slipstream.toolcalls.builtin import calculator, evaluate, lookup, wait
from slipstream.toolcalls.calls import (
    IN_PROCESS,
    INFRA_KINDS,
    MALFORMED_KINDS,
    OUTCOMES,
    InfraKind,
    MalformedCall,
    MalformedKind,
    Outcome,
    ToolCall,
    ToolResult,
    invalid_result,
    tally,
    tool_event,
    with_hidden,
)
from slipstream.toolcalls.chatml import ChatMLRenderer
from slipstream.toolcalls.config import ToolsConfig
from slipstream.toolcalls.execution import LocalTransport, ToolTransport, execute, run_tool
from slipstream.toolcalls.parsing import HERMES_SYNTAX, TAG_SYNTAX, CallSyntax, ParsedTurn, parse_calls
from slipstream.toolcalls.renderer import RENDERERS, ChatMessage, Renderer, renderer_for
from slipstream.toolcalls.tags import TagRenderer
from slipstream.toolcalls.tool import HIDDEN_PREFIX, Tool, ToolDefinitionError, ToolInputError, ToolRegistry

__all__ = [
    "HERMES_SYNTAX",
    "HIDDEN_PREFIX",
    "INFRA_KINDS",
    "IN_PROCESS",
    "MALFORMED_KINDS",
    "OUTCOMES",
    "RENDERERS",
    "TAG_SYNTAX",
    "CallSyntax",
    "ChatMLRenderer",
    "ChatMessage",
    "InfraKind",
    "LocalTransport",
    "MalformedCall",
    "MalformedKind",
    "Outcome",
    "ParsedTurn",
    "Renderer",
    "TagRenderer",
    "Tool",
    "ToolCall",
    "ToolDefinitionError",
    "ToolInputError",
    "ToolRegistry",
    "ToolResult",
    "ToolTransport",
    "ToolsConfig",
    "calculator",
    "evaluate",
    "execute",
    "invalid_result",
    "lookup",
    "parse_calls",
    "renderer_for",
    "run_tool",
    "tally",
    "tool_event",
    "wait",
    "with_hidden",
]
