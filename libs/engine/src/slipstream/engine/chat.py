"""Chat templates: a model's own Jinja template turning messages into the text it was tuned on.

An instruct model only behaves when its prompt looks like its fine-tuning data: SmolLM2 expects
ChatML (`<|im_start|>user\\n...<|im_end|>\\n<|im_start|>assistant\\n`). The template ships with the
model (`chat_template` in tokenizer_config.json, or chat_template.jinja) and is rendered here the
way transformers renders it (a sandboxed Jinja environment, `trim_blocks` and `lstrip_blocks`), so
a prompt we build is byte-for-byte the prompt HF's `apply_chat_template` builds. Roles are the
template's business: system, user, assistant and tool turns all pass through.

The rendered text is then tokenised once, with the template's special markers matched as single
special tokens; token ids are never rebuilt from text after that (see libs/harness).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

ChatMessage = Mapping[str, Any]
"""{"role": "system" | "user" | "assistant" | "tool", "content": str, ...}."""


class ChatTemplate:
    """One model's chat template, compiled once."""

    def __init__(self, source: str, variables: Mapping[str, str] | None = None) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        if not source.strip():
            raise ValueError("empty chat template")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        # The tokenizer's special tokens (bos_token, eos_token, ...), which transformers hands every
        # template: Llama 3's writes `{{ bos_token }}` itself.
        self.variables: dict[str, str] = dict(variables or {})
        self._template = env.from_string(source)

    def render(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for `messages`; with `add_generation_prompt` it ends where the assistant speaks."""
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"chat message {i} needs string 'role' and 'content', got {dict(m)!r}")
        return str(
            self._template.render(
                **self.variables,
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **extra,
            )
        )

    @classmethod
    def from_directory(cls, directory: str | Path, variables: Mapping[str, str] | None = None) -> ChatTemplate | None:
        """The template of an HF model directory (chat_template.jinja or tokenizer_config.json), or None."""
        directory = Path(directory)
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return cls(jinja.read_text(), variables)
        config = directory / "tokenizer_config.json"
        if config.is_file():
            template = json.loads(config.read_text()).get("chat_template")
            if isinstance(template, str) and template.strip():
                return cls(template, variables)
        return None


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")
