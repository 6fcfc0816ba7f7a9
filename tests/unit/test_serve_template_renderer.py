"""The renderer a checkpoint's own template makes (no libs/toolcalls family renders like it), and the choice."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from slipstream.engine.chat import ChatTemplate
from slipstream.serve.template_renderer import TemplateRenderer, renderer_for_model
from slipstream.toolcalls import ChatMessage, Tool, ToolRegistry
from slipstream.toolcalls.calls import ToolCall

pytestmark = pytest.mark.unit

# Llama-3-like habits (bos written by the template, role headers, eos closing a turn), tools counted.
TEMPLATE = (
    "{{ bos_token }}{% if tools %}[{{ tools | length }} tools]{% endif %}"
    "{% for m in messages %}<h>{{ m['role'] }}</h>{{ m['content'] }}"
    "{% for c in m.get('tool_calls', []) %}<tool_call>{{ c['function']['name'] }}</tool_call>{% endfor %}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<h>assistant</h>{% endif %}"
)
WEATHER = Tool("get_weather", "Weather for a city", {"type": "object", "properties": {"city": {"type": "string"}}})


@dataclass
class _Tok:
    chat_template: ChatTemplate | None
    eos_token: str = "<eot>"


def _renderer() -> TemplateRenderer:
    r = renderer_for_model(_Tok(ChatTemplate(TEMPLATE, {"bos_token": "<s>", "eos_token": "<eot>"})))
    assert isinstance(r, TemplateRenderer)
    return r


def test_the_template_renders_with_its_special_tokens_and_tools() -> None:
    r = _renderer()
    assert r.family == "template" and r.stop_strings == ("<eot>",)
    msgs = [ChatMessage(role="user", content="Weather in Paris?")]
    assert r.render(msgs) == "<s><h>user</h>Weather in Paris?<eot><h>assistant</h>"
    assert r.render(msgs, tools=ToolRegistry([WEATHER])).startswith("<s>[1 tools]<h>user</h>")
    call = ToolCall(id="c1", name="get_weather", arguments={"city": "Paris"})
    turn = ChatMessage(role="assistant", content="", tool_calls=(call,))
    assert r.render([*msgs, turn], add_generation_prompt=False).endswith(
        "<h>assistant</h><tool_call>get_weather</tool_call><eot>"
    )


def test_calls_are_parsed_hermes_style_and_the_end_of_turn_is_the_eos() -> None:
    r = _renderer()
    written = r.render_calls("Let me look.", [ToolCall(id="x", name="get_weather", arguments={"city": "Paris"})])
    assert written == 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    parsed = r.parse(written + "<eot>", ToolRegistry([WEATHER]), call_id_prefix="t")
    assert [(c.name, dict(c.arguments)) for c in parsed.calls] == [("get_weather", {"city": "Paris"})]
    assert r.assistant_message("Hi<eot>") == ChatMessage(role="assistant", content="Hi")
    assert r.assistant_message("Hi") is None  # truncated: a re-render would close it where the model did not
    history = [ChatMessage(role="user", content="a")]
    assert r.bridge(history, "b<eot>", [ChatMessage(role="user", content="c")]) == "<h>user</h>c<eot><h>assistant</h>"


def test_a_model_without_a_template_is_served_with_tags_and_a_named_family_wins() -> None:
    assert renderer_for_model(_Tok(None)).family == "tags"
    assert renderer_for_model(_Tok(ChatTemplate(TEMPLATE)), "qwen2.5").family == "qwen2.5"
