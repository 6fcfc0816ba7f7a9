"""Chat requests to prompt ids and completions back to OpenAI messages, through one renderer.

The renderer owns every character of the prompt, tool descriptions and tool-call syntax included,
so what the endpoint serves is what the harness trains on. It follows the loaded model unless
config names a family (`template_renderer.renderer_for_model`: a libs/toolcalls family that renders
as the checkpoint's chat template does, the template itself, or `tags` for a model without one).
The prompt text is tokenised once here, with a bos in front only for a model without a chat
template (as the harness does): a template writes its own start markers, and transformers'
`apply_chat_template` adds nothing to them. The completion's ids come from the engine and its text
is decoded from them, never the other way round.

`template_hash` fingerprints the rendering: sha256 over the family name, its stop strings and
its rendering of a fixed probe conversation (system, user, a tool, an assistant tool call, a tool
result). Any change to what the renderer writes changes the hash, so a recorded call says which
prompt format its tokens were produced under.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from slipstream.engine.tokenizer import Tokenizer
from slipstream.serve.protocol import RequestError
from slipstream.serve.template_renderer import renderer_for_model
from slipstream.toolcalls import ChatMessage, ToolRegistry
from slipstream.toolcalls.calls import ToolCall
from slipstream.toolcalls.tool import Tool, ToolDefinitionError

ROLES = ("system", "user", "assistant", "tool")


@dataclass
class Reply:
    """A completion as an assistant message: its text and the tool calls parsed from it."""

    content: str
    tool_calls: list[dict[str, Any]]
    finish_reason: str


class ChatFormat:
    """One model family's prompt format, tool syntax and stop strings."""

    def __init__(self, family: str, tokenizer: Tokenizer) -> None:
        """`family` names a libs/toolcalls renderer; '' follows the model (see `renderer_for_model`)."""
        self.renderer = renderer_for_model(tokenizer, family)
        self.family = self.renderer.family
        self.tokenizer = tokenizer
        self.stop_strings = tuple(self.renderer.stop_strings)
        self.template_hash = self._fingerprint()

    def _fingerprint(self) -> str:
        probe_tool = Tool("probe", "a probe tool", {"type": "object", "properties": {"q": {"type": "string"}}})
        call = ToolCall(id="c0", name="probe", arguments={"q": "x"})
        probe = [
            ChatMessage(role="system", content="S"),
            ChatMessage(role="user", content="U"),
            ChatMessage(role="assistant", content="A", tool_calls=(call,)),
            ChatMessage(role="tool", content="R", tool_call_id="c0", name="probe"),
        ]
        try:
            text = self.renderer.render(probe, tools=ToolRegistry([probe_tool]))
        except Exception:  # a checkpoint's template may refuse tool turns: its source still fingerprints it
            text = ""
        source = getattr(getattr(self.renderer, "template", None), "source", "")
        parts = [self.family, list(self.stop_strings), text, *([source] if source else [])]
        blob = json.dumps(parts).encode()
        return hashlib.sha256(blob).hexdigest()

    # -------------------------------------------------------------- request side
    def registry(self, tools: Sequence[Any]) -> ToolRegistry | None:
        """The request's `tools` as a registry (descriptions only: the client runs its tools)."""
        if not tools:
            return None
        out = ToolRegistry()
        for i, spec in enumerate(tools):
            fn = spec.get("function") if isinstance(spec, dict) and spec.get("type") == "function" else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(
                    f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param=f"tools[{i}]"
                )
            params = fn.get("parameters") or {"type": "object", "properties": {}}
            try:
                out.add(Tool(fn["name"], str(fn.get("description") or ""), params))
            except (ToolDefinitionError, ValueError) as exc:
                raise RequestError(f"tools[{i}]: {exc}", param=f"tools[{i}]") from None
        return out

    def messages(self, raw: Sequence[Any]) -> list[ChatMessage]:
        """OpenAI messages as renderer messages; a malformed one is refused naming its index."""
        out: list[ChatMessage] = []
        for i, m in enumerate(raw):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or m.get("role") not in ROLES:
                raise RequestError(f"{where} must be an object with 'role' in {list(ROLES)}", param=where)
            content = _text(m.get("content"), where)
            calls: tuple[ToolCall, ...] = ()
            if m["role"] == "assistant" and m.get("tool_calls"):
                calls = tuple(_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"]))
            elif content is None:
                raise RequestError(f"{where}.content is required for role {m['role']!r}", param=f"{where}.content")
            out.append(
                ChatMessage(
                    role=m["role"],
                    content=content or "",
                    tool_calls=calls,
                    tool_call_id=m.get("tool_call_id"),
                    name=m.get("name"),
                )
            )
        return out

    def prompt_text(
        self,
        messages: Sequence[ChatMessage],
        tools: ToolRegistry | None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt for `messages`. With `continue_final_message` the last (assistant) message is
        left open: the conversation before it with the generation prompt, then its text as the
        model would write it, no end of turn, so the completion continues it (vLLM's extra of
        that name; a verdict prefill such as "SCORE:")."""
        if continue_final_message:
            *before, last = messages
            opened = self.renderer.render(before, tools=tools, add_generation_prompt=True)
            return opened + self.renderer.render_calls(last.content, last.tool_calls)
        return self.renderer.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def encode(self, text: str) -> list[int]:
        """Prompt ids as the harness builds them: for a model with a chat template the text alone
        (what `apply_chat_template` gives: SmolLM2's bos is its `<|im_start|>`, which the template
        already opens with); else bos (when the tokenizer has one), then the text."""
        ids = self.tokenizer.encode(text)
        bos = self.tokenizer.bos_id
        if bos is None or getattr(self.tokenizer, "chat_template", None) is not None:
            return ids
        return [bos, *ids]

    # -------------------------------------------------------------- response side
    def reply(self, full: str, cut: str, finish_reason: str, tools: ToolRegistry | None, call_prefix: str) -> Reply:
        """The assistant message of a completion: `full` is its decoded text, `cut` the same cut at
        the stop string. Calls are parsed from `full`, since a family's stop string may be the
        call's own closing tag (`</tool>`); content without calls is `cut`."""
        if tools is None or not len(tools):
            return Reply(content=cut, tool_calls=[], finish_reason=finish_reason)
        turn = self.renderer.parse(full, tools, call_id_prefix=call_prefix)
        calls = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(dict(c.arguments), ensure_ascii=False)},
            }
            for c in turn.calls
        ]
        # A malformed call stays in the text: the client sees exactly what the model wrote.
        if not calls or turn.malformed:
            return Reply(content=cut, tool_calls=[], finish_reason=finish_reason)
        return Reply(content=self.strip_stop(turn.content).strip(), tool_calls=calls, finish_reason="tool_calls")

    def strip_stop(self, text: str) -> str:
        for s in self.stop_strings:
            if text.endswith(s):
                return text[: -len(s)]
        return text


def _text(content: Any, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise RequestError(f"{where}.content[{j}] must be a text part", param=f"{where}.content[{j}]")
            parts.append(p["text"])
        return "".join(parts)
    raise RequestError(f"{where}.content must be a string or an array of text parts", param=f"{where}.content")


def _tool_call(raw: Any, where: str) -> ToolCall:
    fn = raw.get("function") if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise RequestError(f"{where} must have function.name and function.arguments", param=where)
    try:
        args = json.loads(fn.get("arguments") or "{}")
    except ValueError:
        raise RequestError(f"{where}.function.arguments is not JSON", param=f"{where}.function.arguments") from None
    if not isinstance(args, dict):
        raise RequestError(f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments")
    return ToolCall(id=str(raw.get("id") or ""), name=fn["name"], arguments=args)
