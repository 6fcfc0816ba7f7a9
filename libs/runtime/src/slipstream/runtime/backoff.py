"""Exponential backoff: the one way a Slipstream retry decides how long to wait.

A `Backoff` yields `initial_s`, then each delay `factor` times the last, never above `max_s`;
`reset()` starts again from `initial_s` (after a success). `delay(n)` is the n-th delay without
state, for loops that count their own attempts. With `jitter` j > 0 each delay is drawn from
[(1 - j) * d, d], so replicas that failed together do not retry in step. `sleep(stop)` waits the
next delay and returns early when `stop` is set, as a loop that must stay stoppable needs
(`sleep_or_stop` is that wait on its own, for a fixed pause).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
from collections.abc import Iterator


class Backoff(Iterator[float]):
    """Growing delays: initial_s, initial_s * factor, ... capped at max_s (see the module docstring)."""

    def __init__(
        self,
        initial_s: float,
        *,
        factor: float = 2.0,
        max_s: float = math.inf,
        jitter: float = 0.0,
        rng: random.Random | None = None,
    ) -> None:
        if initial_s < 0 or factor < 1 or max_s < 0 or not 0 <= jitter <= 1:
            raise ValueError(
                f"need initial_s >= 0, factor >= 1, max_s >= 0, 0 <= jitter <= 1; "
                f"got {initial_s}, {factor}, {max_s}, {jitter}"
            )
        self.initial_s = initial_s
        self.factor = factor
        self.max_s = max_s
        self.jitter = jitter
        self._rng = rng or random.Random()
        self.attempts = 0  # delays handed out since the last reset

    def delay(self, attempt: int) -> float:
        """The delay before retry number `attempt` (0 = the first), jittered when asked."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        try:
            raw = self.initial_s * self.factor**attempt
        except OverflowError:  # a float power past ~1e308: the cap decides (0 stays 0)
            raw = math.inf if self.initial_s > 0 else 0.0
        d = min(raw, self.max_s)
        if self.jitter:
            d *= 1.0 - self.jitter * self._rng.random()
        return d

    def __next__(self) -> float:
        d = self.delay(self.attempts)
        self.attempts += 1
        return d

    def reset(self) -> None:
        """The next delay is `initial_s` again (call it after a success)."""
        self.attempts = 0

    async def sleep(self, stop: asyncio.Event | None = None) -> float:
        """Wait the next delay, or until `stop` is set; returns the delay that was due."""
        d = next(self)
        if stop is None:
            await asyncio.sleep(d)
        else:
            await sleep_or_stop(stop, d)
        return d


async def sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less when `stop` is set meanwhile."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
