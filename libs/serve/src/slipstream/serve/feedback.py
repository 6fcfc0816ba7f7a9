"""Feedback: `POST /v1/feedback` bodies, their targets, and implicit signals from the next user turn.

A post names exactly one target — `completion_id` (the call id the endpoint returned: the
response `id` `chatcmpl-<call id>` / `cmpl-<call id>`, or the `x-slipstream-call-id` header),
`session_id` (the session's latest call), or `episode_id` (`serve/<session>/<n>`) — and one
signal `{key, value, source}`. Everything resolves to the episode the target was served into;
the pending stage (`slipstream.serve.pending`) keeps the signal there until the episode is
released. The signal's `feedback_id` is the idempotency key; without one it is a digest of
(target, key, source, value), so the same post twice is recorded once.

Implicit signals (`Implicit`): when a session's next chat call arrives, its previous call gets
`followed_up = 1`, and `dissatisfied` = 1 when the new user message matches one of the
configured patterns (else 0) — the user's next move as a reward signal, as production RL systems
use it (a dissatisfied follow-up is one of Cursor's signals).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from typing import Any

import msgspec

from slipstream.schemas import FeedbackSignal
from slipstream.serve.protocol import RequestError

TARGETS = ("completion_id", "session_id", "episode_id")
FIELDS = {*TARGETS, "key", "value", "source", "feedback_id"}
CALL_PREFIXES = ("chatcmpl-", "cmpl-")
MAX_TEXT = 512  # key, source, string value and id lengths (OpenAI's metadata values are <= 512 too)


class FeedbackPost(msgspec.Struct, frozen=True, kw_only=True):
    """A validated feedback post: which target (kind, id) and the signal, its id filled in."""

    kind: str  # one of TARGETS
    target_id: str
    signal: FeedbackSignal


def _text(body: dict[str, Any], name: str, *, required: bool = False, default: str = "") -> str:
    value = body.get(name, default)
    if value is None and not required:
        value = default
    if not isinstance(value, str) or (required and not value.strip()):
        raise RequestError(f"'{name}' must be a non-empty string", param=name)
    if len(value) > MAX_TEXT:
        raise RequestError(f"'{name}' is longer than {MAX_TEXT} characters", param=name)
    return value


def call_id_of(completion_id: str) -> str:
    """The call id in a completion id as the client saw it (`chatcmpl-<id>`, `cmpl-<id>` or bare)."""
    for prefix in CALL_PREFIXES:
        if completion_id.startswith(prefix):
            return completion_id[len(prefix) :]
    return completion_id


def signal_id(target: str, key: str, source: str, value: float | bool | str) -> str:
    blob = json.dumps([target, key, source, value], separators=(",", ":"))
    return "fb-" + hashlib.sha256(blob.encode()).hexdigest()[:32]


def parse_feedback(body: Any, *, now: float) -> FeedbackPost:
    """The post as a `FeedbackPost`; a malformed one is a 400 naming the field."""
    if not isinstance(body, dict):
        raise RequestError("the feedback body must be a JSON object")
    unknown = sorted(set(body) - FIELDS)
    if unknown:
        raise RequestError(
            f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(FIELDS))}", param=unknown[0]
        )
    named = [t for t in TARGETS if body.get(t) is not None]
    if len(named) != 1:
        got = ", ".join(named) if named else "none"
        raise RequestError(f"name exactly one target of {', '.join(TARGETS)} (got {got})", param="completion_id")
    kind = named[0]
    target_id = _text(body, kind, required=True).strip()
    if kind == "completion_id":
        target_id = call_id_of(target_id)
    key = _text(body, "key", required=True)
    if "value" not in body:
        raise RequestError("'value' is required: a number, a boolean or a string", param="value")
    value = body["value"]
    if isinstance(value, bool | str):
        if isinstance(value, str) and len(value) > MAX_TEXT:
            raise RequestError(f"'value' is longer than {MAX_TEXT} characters", param="value")
    elif isinstance(value, int | float):
        value = float(value)
        if value != value or value in (float("inf"), float("-inf")):
            raise RequestError("'value' must be a finite number", param="value")
    else:
        raise RequestError("'value' must be a number, a boolean or a string", param="value")
    source = _text(body, "source", default="user") or "user"
    target = f"{kind.removesuffix('_id')}:{target_id}"
    fid = _text(body, "feedback_id") or signal_id(target, key, source, value)
    signal = FeedbackSignal(key=key, value=value, source=source, feedback_id=fid, target=target, at=now)
    return FeedbackPost(kind=kind, target_id=target_id, signal=signal)


class Implicit:
    """Signals a call earns from its session's next user message (`[endpoint] followup_signal`, ...)."""

    def __init__(self, followup: str, dissatisfied: str, patterns: Sequence[str]) -> None:
        self.followup = followup
        self.dissatisfied = dissatisfied
        try:
            self.patterns = [re.compile(p, re.IGNORECASE) for p in patterns]
        except re.error as exc:
            raise ValueError(f"[endpoint] dissatisfied_patterns: {exc} in {exc.pattern!r}") from None

    @property
    def enabled(self) -> bool:
        return bool(self.followup or self.dissatisfied)

    def signals(self, prev_call: str, user_text: str, *, now: float) -> list[FeedbackSignal]:
        """The signals for `prev_call` given the next user message (ids fixed by call and key)."""
        out = []
        target = f"completion:{prev_call}"
        if self.followup:
            out.append((self.followup, 1.0))
        if self.dissatisfied:
            out.append((self.dissatisfied, 1.0 if any(p.search(user_text) for p in self.patterns) else 0.0))
        return [
            FeedbackSignal(
                key=key,
                value=value,
                source="implicit",
                feedback_id=f"implicit-{prev_call}-{key}",
                target=target,
                at=now,
            )
            for key, value in out
        ]


def last_user_text(messages: Sequence[Any]) -> str | None:
    """The text of the last user message of a chat request (None when it has none)."""
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
            return ""
    return None
