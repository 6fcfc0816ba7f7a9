"""ChatML renderers (`<|im_start|>role\\n...<|im_end|>\\n`) for SmolLM2-Instruct and Qwen2.5.

Both families write a turn as `<|im_start|>{role}\\n{content}<|im_end|>\\n` and prompt the model
with `<|im_start|>assistant\\n`; the model ends its turn with `<|im_end|>` (its eos token), so
the engine stops there and the bridge begins with the `\\n` that follows it — the separator
incremental renderers are known to drop (verl #6501).

Tool calls are Hermes-style, as Qwen2.5's template writes them: after the assistant's text, one
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` per call, separated by newlines.
The families differ in three places, each reproduced character for character from the model's
own chat template (checked in tests/unit/test_tool_renderers.py by rendering the templates):

- default system prompt when the conversation has none;
- tools: Qwen2.5's template lists them in the system turn ("# Tools ... <tools>...</tools>");
  SmolLM2's template has no tools support, so this renderer puts the same block in the system
  text it hands to that template;
- tool results: SmolLM2's template writes any role literally, so each result is a `tool` turn;
  Qwen2.5 folds consecutive results into one `user` turn of `<tool_response>` blocks.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, Literal

from slipstream.toolcalls.calls import ToolCall
from slipstream.toolcalls.parsing import HERMES_SYNTAX, ParsedTurn, parse_calls
from slipstream.toolcalls.renderer import ChatMessage, RendererBase, register_renderer
from slipstream.toolcalls.tool import ToolRegistry

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"

ToolResultStyle = Literal["tool_turns", "user_tool_response"]


def tojson(value: Any) -> str:
    """Jinja's `tojson` as Hugging Face templates run it: `json.dumps` with default separators."""
    return json.dumps(value, ensure_ascii=False)


def tools_block(tools: ToolRegistry) -> str:
    """Qwen2.5's tool description, appended to the system text."""
    specs = "".join("\n" + tojson(s) for s in tools.specs())
    return (
        "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
        f"{specs}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


class ChatMLRenderer(RendererBase):
    syntax = HERMES_SYNTAX

    def __init__(self, family: str, default_system: str, tool_results: ToolResultStyle) -> None:
        self.family = family
        self.default_system = default_system
        self.tool_results = tool_results

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (IM_END,)

    def render_call(self, call: ToolCall) -> str:
        return f'<tool_call>\n{{"name": "{call.name}", "arguments": {tojson(dict(call.arguments))}}}\n</tool_call>'

    def render_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        parts = ([content] if content else []) + [self.render_call(c) for c in calls]
        return "\n".join(parts)

    @staticmethod
    def turn(role: str, content: str) -> str:
        return f"{IM_START}{role}\n{content}{IM_END}\n"

    def render(
        self, messages: Sequence[ChatMessage], *, tools: ToolRegistry | None = None, add_generation_prompt: bool = True
    ) -> str:
        out: list[str] = []
        rest = list(messages)
        system = self.default_system
        if rest and rest[0].role == "system":
            system = rest.pop(0).content
        if tools is not None and len(tools):
            system += tools_block(tools)
        out.append(self.turn("system", system))
        i = 0
        while i < len(rest):
            m = rest[i]
            if m.role == "tool" and self.tool_results == "user_tool_response":
                block = []
                while i < len(rest) and rest[i].role == "tool":
                    block.append(f"\n<tool_response>\n{rest[i].content}\n</tool_response>")
                    i += 1
                out.append(f"{IM_START}user{''.join(block)}{IM_END}\n")
                continue
            content = self.render_calls(m.content, m.tool_calls) if m.role == "assistant" else m.content
            out.append(self.turn(m.role, content))
            i += 1
        if add_generation_prompt:
            out.append(f"{IM_START}assistant\n")
        return "".join(out)

    def parse(self, completion: str, registry: ToolRegistry, *, call_id_prefix: str = "call") -> ParsedTurn:
        text = completion[: -len(IM_END)] if completion.endswith(IM_END) else completion
        return parse_calls(text, registry, self.syntax, call_id_prefix=call_id_prefix)

    def assistant_message(self, completion: str) -> ChatMessage | None:
        # Unsure cases: a truncated turn (no eos) and control strings the model wrote inside its
        # text, which a re-render would not reproduce token for token.
        if not completion.endswith(IM_END):
            return None
        content = completion[: -len(IM_END)]
        if IM_START in content or IM_END in content:
            return None
        return ChatMessage(role="assistant", content=content)


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
QWEN25_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."

register_renderer("smollm2", lambda: ChatMLRenderer("smollm2", SMOLLM2_SYSTEM, "tool_turns"))
register_renderer("qwen2.5", lambda: ChatMLRenderer("qwen2.5", QWEN25_SYSTEM, "user_tool_response"))
