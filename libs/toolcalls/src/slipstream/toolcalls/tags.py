"""Plain-text tags for byte-level models that have no chat template.

A call is `<tool>{"name": ..., "args": {...}}</tool>` (generation stops at `</tool>`), a result
comes back as `<result>...</result>` followed by a newline, and the model continues in the same
stream. With byte-level tokens and no scaffolding the bridge is exactly the result text, which
makes this path the reference the chat-template renderers are compared with.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from slipstream.toolcalls.calls import ToolCall
from slipstream.toolcalls.parsing import TAG_SYNTAX
from slipstream.toolcalls.renderer import ChatMessage, RendererBase, register_renderer
from slipstream.toolcalls.tool import ToolRegistry

RESULT_OPEN = "<result>"
RESULT_CLOSE = "</result>"


class TagRenderer(RendererBase):
    family = "tags"
    syntax = TAG_SYNTAX

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.syntax.close_tag,)

    def describe_tools(self, tools: ToolRegistry) -> str:
        """A compact preamble: how to call, then one JSON line per tool."""
        lines = [f"Call a tool as {self.syntax.example}; its answer comes back as {RESULT_OPEN}...{RESULT_CLOSE}."]
        for t in tools:
            lines.append(json.dumps({"name": t.name, "description": t.description, "parameters": t.shown_parameters()}))
        return "\n".join(lines) + "\n"

    def render_call(self, call: ToolCall) -> str:
        payload = {"name": call.name, self.syntax.args_key: dict(call.arguments)}
        return f"{self.syntax.open_tag}{json.dumps(payload, ensure_ascii=False)}{self.syntax.close_tag}"

    def render_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        return content + "".join(self.render_call(c) for c in calls)

    def render(
        self, messages: Sequence[ChatMessage], *, tools: ToolRegistry | None = None, add_generation_prompt: bool = True
    ) -> str:
        out = [self.describe_tools(tools)] if tools is not None and len(tools) else []
        for m in messages:
            if m.role in ("system", "user"):
                out.append(m.content + "\n")
            elif m.role == "assistant":
                out.append(self.render_calls(m.content, m.tool_calls))
            else:
                out.append(f"{RESULT_OPEN}{m.content}{RESULT_CLOSE}\n")
        return "".join(out)

    def assistant_message(self, completion: str) -> ChatMessage | None:
        return ChatMessage(role="assistant", content=completion)


register_renderer("tags", TagRenderer)
