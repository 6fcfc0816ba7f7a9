"""The renderer the runner gives verifiers' training client: the next turn extends the sampled ids.

Runs in verifiers' venv (loaded by the `renderers` package from this file's path, `runner.py`
names it); it imports nothing of Slipstream. `renderers`' `DefaultRenderer` (a Jinja chat
template) never bridges a turn: each call re-renders the whole conversation, so the model's
earlier replies come back as their decoded text encoded again. With the byte-level tokenizer a
reply that is not valid UTF-8, a tool call written with other spacing than the template's
`tojson`, or text beside a tool call comes back as other ids; the prompt then no longer extends
the episode's sample, the route opens a second sample, and what trains is not one sequence of
what the model produced.

`ExtendingRenderer.bridge_to_next_turn` keeps the previous prompt and completion ids verbatim,
closes the turn with eos when the completion was cut at max_tokens (the template closes an
assistant turn with eos), and appends what the template renders for the new messages (a tool
result, the next user turn) and the next generation prompt. Those added ids come from two renders
of a stand-in conversation, with and without the new messages; where the template is not
prefix-stable under them, or closes an assistant turn without eos, it answers None and the
client re-renders as before.
"""

from __future__ import annotations

from typing import Any

from renderers.base import RenderedTokens, trim_to_turn_close  # type: ignore[import-not-found]
from renderers.configs import DefaultRendererConfig  # type: ignore[import-not-found]
from renderers.default import DefaultRenderer  # type: ignore[import-not-found]

# A closed exchange the new messages are rendered after: its content is irrelevant, the template's
# layout around it is what is measured.
STAND_IN = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


def _role(message: Any) -> str:
    return str(message.get("role") if isinstance(message, dict) else getattr(message, "role", ""))


class ExtendingRenderer(DefaultRenderer):  # type: ignore[misc]
    """DefaultRenderer whose next turn keeps every earlier id (module docstring)."""

    config_class = DefaultRendererConfig

    def bridge_to_next_turn(
        self,
        previous_prompt_ids: list[int],
        previous_completion_ids: list[int],
        new_messages: list[Any],
        *,
        tools: list[Any] | None = None,
        **kwargs: Any,
    ) -> RenderedTokens | None:
        eos = self._tokenizer.eos_token_id
        if eos is None or kwargs or not new_messages or any(_role(m) == "assistant" for m in new_messages):
            return None  # an assistant message would re-render sampled content
        prior = trim_to_turn_close(previous_prompt_ids, previous_completion_ids, {eos}, synthesize_close=eos)
        closed = list(self._apply(STAND_IN, tools=tools))
        full = list(self._apply([*STAND_IN, *new_messages], tools=tools, add_generation_prompt=True))
        if eos not in closed or full[: len(closed)] != closed:
            return None
        cut = len(closed) - closed[::-1].index(eos)  # just past the stand-in assistant's closing eos
        added = full[cut:]
        return RenderedTokens(
            token_ids=[*prior, *added],
            message_indices=[-1] * (len(prior) + len(added)),
        )
