"""Call memory: the replies of recent call ids, so a retried call is answered and not run twice.

A caller re-sends a call (same `call_id`) when its first attempt got no reply in time. When the
retry lands on the replica that is still running, or already ran, the call, it joins that run
(or gets its reply) instead of running the tool again: for a tool with side effects (a sandbox
command) that is the difference between once and twice. Retries that land on another replica run
there; tools are expected to be idempotent by call id across replicas (the built-in ones are
pure functions of their arguments).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict

from slipstream.schemas.tools import ToolReply


class CallMemory:
    """Futures of the last `size` call ids, each kept at most `ttl_s` seconds."""

    def __init__(self, size: int, ttl_s: float) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self._calls: OrderedDict[str, tuple[float, asyncio.Future[ToolReply]]] = OrderedDict()

    def claim(self, call_id: str) -> tuple[asyncio.Future[ToolReply], bool]:
        """The future of `call_id`'s reply and whether this caller must produce it (True: a new call)."""
        now = time.monotonic()
        self._expire(now)
        found = self._calls.get(call_id)
        if found is not None:
            return found[1], False
        future: asyncio.Future[ToolReply] = asyncio.get_running_loop().create_future()
        if self.size > 0:
            self._calls[call_id] = (now, future)
            while len(self._calls) > self.size:
                self._calls.popitem(last=False)
        return future, True

    def forget(self, call_id: str) -> None:
        """Drop a call whose run did not finish (cancelled), so a retry runs it afresh."""
        self._calls.pop(call_id, None)

    def _expire(self, now: float) -> None:
        while self._calls:
            _, (at, _) = next(iter(self._calls.items()))
            if now - at <= self.ttl_s:
                return
            self._calls.popitem(last=False)

    def __len__(self) -> int:
        return len(self._calls)
