"""Per-judge limits: a token bucket for calls per second, and the wait a rate-limited judge asks for.

Concurrency is an `asyncio.Semaphore` in the judge itself; the bucket bounds the *rate* at which
calls start (verl's `limited` reward manager keeps both, since a judge endpoint can be saturated
by a few slow calls or by many quick ones). Retry-After is honoured as the server sends it,
seconds or an HTTP date (RFC 9110), plus the `retry-after-ms` header OpenAI-style servers send;
the caller caps it at its `max_backoff_s`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from email.utils import parsedate_to_datetime


class TokenBucket:
    """`rate` tokens per second up to `burst`; `acquire` waits for one. rate 0 never waits."""

    def __init__(self, rate: float, burst: int = 1, *, clock: Callable[[], float] = time.monotonic) -> None:
        if rate < 0 or burst < 1:
            raise ValueError(f"token bucket needs rate >= 0 and burst >= 1, got rate {rate}, burst {burst}")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()
        self._lock = asyncio.Lock()
        self.waited_s = 0.0
        """Total time callers spent waiting for a token (a judge that is rate-bound shows it here)."""

    async def acquire(self) -> None:
        if self.rate == 0:
            return
        # One waiter at a time refills and takes: first come, first served, no thundering herd.
        async with self._lock:
            while True:
                now = self._clock()
                self._tokens = min(float(self.burst), self._tokens + (now - self._stamp) * self.rate)
                self._stamp = now
                if self._tokens >= 1.0:
                    self._tokens -= 1.0
                    return
                wait = (1.0 - self._tokens) / self.rate
                self.waited_s += wait
                await asyncio.sleep(wait)


def retry_after_s(headers: Mapping[str, str] | None, *, now: float | None = None) -> float | None:
    """Seconds a 429/503 response asks the client to wait, or None when it names no usable wait."""
    if not headers:
        return None
    lowered = {k.lower(): v for k, v in headers.items()}
    ms = lowered.get("retry-after-ms")
    if ms is not None:
        try:
            value = float(ms) / 1000.0
        except ValueError:
            value = math.nan
        if math.isfinite(value) and value >= 0:
            return value
    raw = lowered.get("retry-after")
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        try:
            when = parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        value = when.timestamp() - (time.time() if now is None else now)
        return max(0.0, value)
    return value if math.isfinite(value) and value >= 0 else None
