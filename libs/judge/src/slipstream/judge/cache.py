"""The verdict cache in Redis: a rubric's score of a prompt by a judge model is asked for once.

Keys are `slipstream:judge:<context>@<version>:<rubric id>:<digest>`, where the digest is a sha256
of the judge model, the full judge messages (rubric text, task, reference, response) and the
sampling settings (`verdict.prompt_digest`). A new rubric version, another judge model or any
change of the prompt is therefore a new key; entries expire after the judge's `cache_ttl_s`.
Keys are not per run: the same verdict serves every run that asks the same question.

Only parsed, valid scores are stored; an unscorable rubric is never cached (the next episode that
meets it asks again). Redis being unreachable is not an error for judging: a lookup that fails
is a miss and a store that fails is skipped, both counted, and the judge carries on (the control
client's `healthy` flag shows the outage).
"""

from __future__ import annotations

import math

from slipstream.control.client import ControlClient, ControlUnavailable
from slipstream.telemetry.logs import get_logger
from slipstream.telemetry.metrics import counter

log = get_logger(__name__)

ERRORS = counter("judge/cache/errors", "Verdict-cache operations that could not reach Redis (label op).")
PREFIX = "slipstream:judge"


def cache_key(rubric_set: str, rubric_id: str, digest: str) -> str:
    """The Redis key of one verdict: rubric set label ('context@version'), rubric id, prompt digest."""
    return f"{PREFIX}:{rubric_set}:{rubric_id}:{digest}"


class VerdictCache:
    """Scores in [0, 1] by key, with a TTL, over a `ControlClient` (bounded operations)."""

    def __init__(self, client: ControlClient, *, ttl_s: int) -> None:
        if ttl_s < 1:
            raise ValueError(f"cache ttl_s must be >= 1, got {ttl_s}")
        self.client = client
        self.ttl_s = ttl_s

    async def get(self, key: str) -> float | None:
        """The cached score, or None on a miss (or when Redis cannot be reached)."""
        try:
            raw = await self.client.call("judge_cache_get", lambda r: r.get(key))
        except ControlUnavailable as exc:
            ERRORS.add(1, op="get")
            log.debug("verdict cache lookup failed", error=str(exc))
            return None
        if raw is None:
            return None
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and 0.0 <= value <= 1.0):
            # Not written by this code (or corrupted): treat as a miss; the next store overwrites it.
            log.warning("verdict cache entry is not a score in [0, 1]; ignored", key=key, value=str(raw)[:40])
            return None
        return value

    async def put(self, key: str, score: float) -> None:
        """Store a valid score; a failure to reach Redis is counted and skipped."""
        if not (math.isfinite(score) and 0.0 <= score <= 1.0):
            raise ValueError(f"only scores in [0, 1] are cached, got {score}")
        try:
            await self.client.call("judge_cache_put", lambda r: r.set(key, repr(score), ex=self.ttl_s))
        except ControlUnavailable as exc:
            ERRORS.add(1, op="put")
            log.debug("verdict cache store failed", error=str(exc))

    async def close(self) -> None:
        await self.client.close()
