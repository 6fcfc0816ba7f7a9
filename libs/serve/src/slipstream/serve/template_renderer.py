"""The renderer a served model's own chat template makes, and the choice of renderer per model.

The endpoint's prompt format follows the loaded model. A checkpoint that ships a chat template
(tokenizer_config.json or chat_template.jinja) is served either through the libs/toolcalls family
renderer whose rendering equals that template on probe conversations (SmolLM2's template is
ChatML with its own default system prompt: the `smollm2` renderer, which adds the tool support
the template lacks), or, when no family matches (a Qwen3, a Llama 3, a Mistral checkpoint), through
`TemplateRenderer`: the template itself, rendered as transformers renders it, with tool calls
written and parsed Hermes-style (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the
syntax Qwen and Hermes templates use) and the tokenizer's eos token as the end of a turn. A
tokenizer without a template (the byte-level tiny models) is served with `tags`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from slipstream.engine.chat import ChatTemplate
from slipstream.engine.tokenizer import Tokenizer
from slipstream.toolcalls import ChatMessage, ToolRegistry, renderer_for
from slipstream.toolcalls.calls import ToolCall
from slipstream.toolcalls.parsing import HERMES_SYNTAX, ParsedTurn, parse_calls
from slipstream.toolcalls.renderer import Renderer, RendererBase

# Families whose hand-written renderer may stand for a checkpoint's template (when it renders the same).
CHAT_FAMILIES = ("smollm2", "qwen2.5")
_PROBES: tuple[tuple[ChatMessage, ...], ...] = (
    (ChatMessage(role="user", content="Hi"),),
    (ChatMessage(role="system", content="Be brief."), ChatMessage(role="user", content="2+2?")),
    (
        ChatMessage(role="user", content="A"),
        ChatMessage(role="assistant", content="B"),
        ChatMessage(role="user", content="C"),
    ),
)


class TemplateRenderer(RendererBase):
    """A checkpoint's own chat template as a renderer (family `template`)."""

    family = "template"
    syntax = HERMES_SYNTAX

    def __init__(self, template: ChatTemplate, end_of_turn: str) -> None:
        if not end_of_turn:
            raise ValueError("a template renderer needs the tokenizer's end-of-turn (eos) token text")
        self.template = template
        self.end_of_turn = end_of_turn

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return (self.end_of_turn,)

    def render(
        self, messages: Sequence[ChatMessage], *, tools: ToolRegistry | None = None, add_generation_prompt: bool = True
    ) -> str:
        extra: dict[str, Any] = {}
        if tools is not None and len(tools):
            extra["tools"] = tools.specs()
        return self.template.render(
            [_hf_message(m) for m in messages], add_generation_prompt=add_generation_prompt, **extra
        )

    def render_calls(self, content: str, calls: Sequence[ToolCall]) -> str:
        parts = [content] if content else []
        for c in calls:
            body = json.dumps({"name": c.name, "arguments": dict(c.arguments)}, ensure_ascii=False)
            parts.append(f"<tool_call>\n{body}\n</tool_call>")
        return "\n".join(parts)

    def parse(self, completion: str, registry: ToolRegistry, *, call_id_prefix: str = "call") -> ParsedTurn:
        text = completion.removesuffix(self.end_of_turn)
        return parse_calls(text, registry, self.syntax, call_id_prefix=call_id_prefix)

    def assistant_message(self, completion: str) -> ChatMessage | None:
        if not completion.endswith(self.end_of_turn):
            return None  # truncated: a re-render would close the turn where the model did not
        content = completion[: -len(self.end_of_turn)]
        if self.end_of_turn in content:
            return None
        return ChatMessage(role="assistant", content=content)


def _hf_message(m: ChatMessage) -> dict[str, Any]:
    """A renderer message as transformers' chat templates read it."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        out["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": dict(c.arguments)}}
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        out["name"] = m.name
    return out


def renderer_for_model(tokenizer: Tokenizer, family: str = "") -> Renderer:
    """The renderer serving `tokenizer`'s model: `family` when named; else a family renderer that
    renders the probes exactly as the model's template does, else the template itself; `tags`
    for a tokenizer without a template."""
    if family:
        return renderer_for(family)
    template: ChatTemplate | None = getattr(tokenizer, "chat_template", None)
    if template is None:
        return renderer_for("tags")
    for name in CHAT_FAMILIES:
        candidate = renderer_for(name)
        try:
            same = all(
                candidate.render(list(p)) == template.render([_hf_message(m) for m in p], add_generation_prompt=True)
                for p in _PROBES
            )
        except Exception:  # the template fails on a probe (raise_exception, a missing variable): not this family
            same = False
        if same:
            return candidate
    return TemplateRenderer(template, str(getattr(tokenizer, "eos_token", "") or ""))
