"""`search_call`: answer a factual question with exactly one search call, `<search>query</search>`.

The real-model task. SmolLM2-135M-Instruct, shown a system prompt and one solved exchange
(one-shot), writes a well-formed call for most questions but not all: measured on this CPU it
starts between "never" and "always" (shared/reference/real-model.md: 61-78 % for this format), so
a group of samples usually disagrees and GRPO has signal. What it must learn generalises across
topics — the format, and to put the question's subject in the query — so held-out questions
(other subjects, other question forms) measure learning rather than memorising.

Prompt (chat models): a system turn saying how to call the tool, one demo exchange, then the
question (`chat_messages`). Byte-level models see the question alone.

Scoring (components sum to the reward; a right answer scores 1.0):
- `format` (0.5): the reply is exactly one call: `<search>`, a non-empty query, `</search>`,
  nothing before or after (whitespace aside). Rollouts stop at `</search>` (the terminator).
- `query` (0.5): some `<search>...</search>` in the reply has a query of at most `max_query_words`
  words that names the question's subject (case-insensitive).
`correct` needs both. A reply with no complete call is a parse failure (reward 0).
"""

from __future__ import annotations

import random
import re
from typing import Annotated, ClassVar

import msgspec

from slipstream.envs.base import Environment, Problem, Score, TaskSpec
from slipstream.envs.registry import register

Doc = msgspec.Meta

_CALL = re.compile(r"<search>(.*?)</search>", re.DOTALL)

SYSTEM = (
    "You are a search assistant. You cannot answer from memory. To answer a question, call the "
    "search tool: reply with exactly <search>your query</search> and nothing else."
)
DEMO_QUESTION = "What is the capital of Kenya?"
DEMO_CALL = "<search>capital of Kenya</search>"

COUNTRIES = (
    "Brazil", "Peru", "Chile", "Canada", "Mexico", "Egypt", "Nigeria", "Ghana", "Morocco", "Ethiopia",
    "India", "China", "Japan", "Vietnam", "Thailand", "Indonesia", "Australia", "Norway", "Sweden", "Finland",
    "Poland", "Spain", "Portugal", "Greece", "Turkey", "Iran", "Argentina", "Colombia", "Cuba", "Iceland",
)  # fmt: skip
PEOPLE = (
    "Marie Curie", "Albert Einstein", "Ada Lovelace", "Nelson Mandela", "Frida Kahlo", "Isaac Newton",
    "Charles Darwin", "Leonardo da Vinci", "Mahatma Gandhi", "Alan Turing", "Jane Austen", "Nikola Tesla",
    "Galileo Galilei", "Rosalind Franklin", "Wolfgang Mozart", "Pablo Picasso", "Florence Nightingale",
    "Louis Pasteur", "Simon Bolivar", "Confucius",
)  # fmt: skip
PLACES = (
    "Mount Everest", "the Eiffel Tower", "the Amazon River", "the Sahara Desert", "Lake Victoria",
    "the Great Wall of China", "Mount Kilimanjaro", "the Nile", "the Grand Canyon", "Niagara Falls",
    "the Pacific Ocean", "Mont Blanc", "the Danube", "Lake Baikal", "the Colosseum",
)  # fmt: skip
QUESTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("What is the population of {}?", COUNTRIES),
    ("What currency does {} use?", COUNTRIES),
    ("What is the largest city in {}?", COUNTRIES),
    ("Which languages are spoken in {}?", COUNTRIES),
    ("When was {} born?", PEOPLE),
    ("Where did {} die?", PEOPLE),
    ("What is {} famous for?", PEOPLE),
    ("How big is {}?", PLACES),
    ("Where is {} located?", PLACES),
    ("How old is {}?", PLACES),
)


class SearchCallOptions(msgspec.Struct, kw_only=True, frozen=True, forbid_unknown_fields=True):
    """Options of `search_call`."""

    format_reward: Annotated[float, Doc(description="Reward component for a reply that is exactly one call.")] = 0.5
    query_reward: Annotated[float, Doc(description="Reward component for a query naming the subject.")] = 0.5
    max_query_words: Annotated[int, Doc(description="Longest query (in words) that earns query_reward.", ge=1)] = 12
    one_shot: Annotated[bool, Doc(description="Show one solved exchange before the question (chat models).")] = True


def _subject_words(subject: str) -> str:
    return subject.removeprefix("the ").lower()


@register("search_call")
class SearchCall(Environment[SearchCallOptions]):
    """Single-turn: reply to a question with one `<search>query</search>` call naming its subject."""

    version: ClassVar[str] = "1"
    Options: ClassVar[type[msgspec.Struct]] = SearchCallOptions
    components: ClassVar[tuple[str, ...]] = ("format", "query")
    terminator: ClassVar[str] = "</search>"

    @property
    def max_completion_chars(self) -> int:
        return 48

    def sample(self, rng: random.Random) -> Problem:
        form, subjects = rng.choice(QUESTIONS)
        subject = rng.choice(subjects)
        question = form.format(subject)
        return Problem(key=question, prompt=question, reference=subject)

    def chat_messages(self, task: TaskSpec, prompt: str) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": SYSTEM}]
        if self.options.one_shot:
            messages += [{"role": "user", "content": DEMO_QUESTION}, {"role": "assistant", "content": DEMO_CALL}]
        return [*messages, {"role": "user", "content": prompt}]

    def sft_example(self, task: TaskSpec) -> str:
        return f"<search>{task.prompt.rstrip('?')}</search>"

    def grade(self, task: TaskSpec, completion: str) -> Score:
        calls = _CALL.findall(completion)
        if not calls:
            return self.failure(f"no <search>...</search> call in {completion[:48]!r}")
        text = completion.strip()
        exact = _CALL.fullmatch(text) is not None and bool(calls[0].strip())
        subject = _subject_words(task.reference)
        named = any(subject in q.lower() and len(q.split()) <= self.options.max_query_words for q in calls)
        reasons = [
            "one call" if exact else f"text around the call: {text[:48]!r}",
            "query names the subject" if named else f"no query names {task.reference!r}: {calls[0][:48]!r}",
        ]
        return Score.of(
            {
                "format": self.options.format_reward if exact else 0.0,
                "query": self.options.query_reward if named else 0.0,
            },
            correct=exact and named,
            parse_ok=True,
            reason="; ".join(reasons),
        )
