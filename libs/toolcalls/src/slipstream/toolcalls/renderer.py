"""The renderer boundary: one object per model family owns every character between turns.

A renderer turns messages into the exact prompt text, writes tool calls the way the model should
write them, parses what the model wrote, and — the fragile part — says what text goes between a
completion and the next generation prompt (`bridge`). The bridge is never guessed: it is the
suffix of the full rendering after `prompt + completion`, and `bridge` returns None when that
prefix property does not hold or cannot be trusted (a truncated completion, template control
strings inside the completion). On None the harness starts a new sample from the full rendering
instead of appending.

This is a pure text/message-level API: token ids are the tokenizer's business (special tokens
such as `<|im_end|>` must be tokenized as one control token each).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from slipstream.toolcalls.calls import ToolCall, ToolResult
from slipstream.toolcalls.parsing import CallSyntax, ParsedTurn, parse_calls
from slipstream.toolcalls.tool import ToolRegistry

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ChatMessage:
    """One message. An assistant message either holds the raw sampled text in `content` (what the
    engine produced, calls included) or a `content` plus structured `tool_calls` (scripted or SFT
    turns); the renderer writes both the same way."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None


class Renderer(Protocol):
    family: str
    syntax: CallSyntax

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """Strings at which generation of an assistant turn must stop."""
        ...

    def render(
        self, messages: Sequence[ChatMessage], *, tools: ToolRegistry | None = None, add_generation_prompt: bool = True
    ) -> str: ...

    def render_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        """The assistant text for `content` followed by `calls`, as the model should write it."""
        ...

    def parse(self, completion: str, registry: ToolRegistry, *, call_id_prefix: str = "call") -> ParsedTurn: ...

    def assistant_message(self, completion: str) -> ChatMessage | None:
        """The history entry for a sampled completion, or None when the completion cannot be
        re-rendered faithfully (truncated, or it contains template control strings)."""
        ...

    def result_messages(self, results: Sequence[ToolResult]) -> list[ChatMessage]: ...

    def bridge(
        self,
        history: Sequence[ChatMessage],
        completion: str,
        new_messages: Sequence[ChatMessage],
        *,
        tools: ToolRegistry | None = None,
    ) -> str | None: ...


class RendererBase:
    """The shared parts: parsing with the family's syntax, tool messages, and the verified bridge."""

    family: str
    syntax: CallSyntax

    def render(
        self, messages: Sequence[ChatMessage], *, tools: ToolRegistry | None = None, add_generation_prompt: bool = True
    ) -> str:
        raise NotImplementedError

    def assistant_message(self, completion: str) -> ChatMessage | None:
        raise NotImplementedError

    def parse(self, completion: str, registry: ToolRegistry, *, call_id_prefix: str = "call") -> ParsedTurn:
        return parse_calls(completion, registry, self.syntax, call_id_prefix=call_id_prefix)

    def result_messages(self, results: Sequence[ToolResult]) -> list[ChatMessage]:
        return [ChatMessage(role="tool", content=r.text, tool_call_id=r.call_id, name=r.name) for r in results]

    def bridge(
        self,
        history: Sequence[ChatMessage],
        completion: str,
        new_messages: Sequence[ChatMessage],
        *,
        tools: ToolRegistry | None = None,
    ) -> str | None:
        """Text to append after `render(history) + completion` so that the result equals
        `render(history + [assistant] + new_messages)` exactly; None when unsure."""
        turn = self.assistant_message(completion)
        if turn is None:
            return None
        prefix = self.render(history, tools=tools) + completion
        full = self.render([*history, turn, *new_messages], tools=tools)
        if not full.startswith(prefix):
            return None
        return full[len(prefix) :]


RENDERERS: dict[str, Callable[[], Renderer]] = {}


def register_renderer(family: str, factory: Callable[[], Renderer]) -> None:
    RENDERERS[family] = factory


def renderer_for(family: str) -> Renderer:
    """The renderer of a model family (`tags`, `smollm2`, `qwen2.5`, ...); unknown names are an error."""
    try:
        return RENDERERS[family]()
    except KeyError:
        raise ValueError(f"no renderer for model family {family!r}; known: {', '.join(sorted(RENDERERS))}") from None
