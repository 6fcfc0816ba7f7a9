"""The judge protocol: the prompt a judge gets for one rubric, and the strict parse of its verdict.

Verdict format (told to the judge in the system message): the answer either ends with one line

    SCORE: <n>

where n is a number from 0 to 10, or is exactly a JSON object `{"score": <n>}` (a ```json fence
around it is tolerated). Anything else — no such last line, a number outside 0..10, NaN, extra
keys beside a non-numeric score — is malformed: the caller re-asks, a bounded number of times,
then gives up with an explicit *unscorable* result. No default score is ever made up.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any

from slipstream.schemas import Episode

SCORE_MAX = 10.0
_SCORE_LINE = re.compile(r"^SCORE:\s*([+-]?(?:\d+(?:\.\d*)?|\.\d+))\s*$")
_FENCE = re.compile(r"^```(?:json)?\s*\n(.*)\n```$", re.DOTALL)

SYSTEM = (
    "You are a strict grader. You judge one response against one criterion (the rubric), "
    "nothing else. Reason briefly if you need to, then end your answer with exactly one line\n"
    "SCORE: <n>\n"
    "where <n> is a number from 0 (the criterion is not met at all) to 10 (fully met). "
    'Instead you may answer with only the JSON object {"score": <n>}.'
)
NO_PROMPT = "(the task text was not recorded; judge the response on its own)"


class MalformedVerdict(ValueError):
    """The judge's answer does not follow the verdict format; the message says how."""


PROMPT_KEY = "prompt"
"""`Episode.metadata` key of the task text a judge is shown (episodes carry token ids, not the prompt)."""


@dataclass(frozen=True)
class JudgeInput:
    """What a judge sees of an episode."""

    episode_id: str
    response: str
    prompt: str = ""
    reference: str = ""

    @classmethod
    def of(cls, episode: Episode) -> JudgeInput:
        """An episode's final answer, its task text (`metadata['prompt']`, when recorded) and reference."""
        return cls(
            episode_id=episode.episode_id,
            response=episode.final_text,
            prompt=episode.metadata.get(PROMPT_KEY, ""),
            reference=episode.reference,
        )


def parse_verdict(text: str) -> float:
    """The verdict's score normalised to [0, 1]; `MalformedVerdict` when the format is not met."""
    body = (text or "").strip()
    if not body:
        raise MalformedVerdict("empty answer")
    fenced = _FENCE.match(body)
    candidate = fenced.group(1).strip() if fenced else body
    if candidate.startswith("{"):
        return _score_of_json(candidate)
    last = body.splitlines()[-1].strip()
    m = _SCORE_LINE.match(last)
    if m is None:
        raise MalformedVerdict(
            f"the last line {last[:80]!r} is not 'SCORE: <0-10>' and the answer is not a JSON object"
        )
    return _checked(float(m.group(1)))


def _score_of_json(candidate: str) -> float:
    try:
        obj: Any = json.loads(candidate)
    except json.JSONDecodeError as exc:
        raise MalformedVerdict(f"answer looks like JSON but does not parse: {exc}") from None
    if not isinstance(obj, dict) or "score" not in obj:
        raise MalformedVerdict('JSON answer has no "score" key')
    value = obj["score"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedVerdict(f'JSON "score" is {value!r}, not a number')
    return _checked(float(value))


def _checked(score: float) -> float:
    if not math.isfinite(score) or not 0.0 <= score <= SCORE_MAX:
        raise MalformedVerdict(f"score {score:g} is outside 0..{SCORE_MAX:g}")
    return score / SCORE_MAX


def judge_messages(rubric_text: str, item: JudgeInput) -> list[dict[str, str]]:
    """The chat messages asking for one rubric's verdict on one response."""
    parts = [
        f"<rubric>\n{rubric_text.strip()}\n</rubric>",
        f"<task>\n{item.prompt.strip() or NO_PROMPT}\n</task>",
    ]
    if item.reference.strip():
        parts.append(f"<reference>\n{item.reference.strip()}\n</reference>")
    parts.append(f"<response>\n{item.response}\n</response>")
    parts.append("Score the response against the rubric.")
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "\n\n".join(parts)}]


def reask_message(problem: str) -> dict[str, str]:
    """The follow-up after a malformed verdict: what was wrong and the format again."""
    return {
        "role": "user",
        "content": f"Your answer did not follow the required format ({problem}). Answer again and end with "
        'exactly one line "SCORE: <n>" with n from 0 to 10.',
    }


def prompt_digest(messages: list[dict[str, str]], *, model: str, temperature: float, max_tokens: int) -> str:
    """Hex sha256 of everything that determines a verdict: judge model, messages, sampling settings."""
    canonical = json.dumps(
        {"model": model, "messages": messages, "temperature": temperature, "max_tokens": max_tokens},
        sort_keys=True,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode()).hexdigest()
