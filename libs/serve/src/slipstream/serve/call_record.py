"""One served call exactly as the engine ran it: what the recorder keeps and assembly reads.

Its own module because both sides use it: `record.Recorder` collects these per session and
`episodes.assemble` turns a session's list into an `Episode`.
"""

from __future__ import annotations

import msgspec

from slipstream.engine.interface import SamplingParams


class CallRecord(msgspec.Struct, kw_only=True):
    """One served call exactly as the engine ran it (kept in process; episodes are what leave it)."""

    call_id: str
    session_id: str
    endpoint: str
    model: str
    created: float
    finished_at: float
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    segments: list[tuple[int, int]]
    finish_reason: str
    params: SamplingParams
    template_hash: str
    text: str = ""
    task_text: str = ""
    """What the call asked: the last user message (chat) or the prompt text (completions); judges read it."""
    request_hash: str = ""
    retry_key: str = ""
    group_key: str = ""
    """The prompt group the call's rollout belongs to ('' none): its episode is released with the key's others."""
    group_size: int = 0
    """Members the group key asks for (0: the pending policy's `group_size`)."""

    @property
    def policy_versions(self) -> list[int]:
        return [v for v, n in self.segments for _ in range(n)]

    @property
    def newest_version(self) -> int:
        return self.segments[-1][0] if self.segments else -1
