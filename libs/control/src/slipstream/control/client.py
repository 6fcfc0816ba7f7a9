"""The control plane's Redis connection: bounded operations, one error type, a health flag.

Every component (lease, ledger, task statistics, eval history) talks to Redis through one
`ControlClient`, so three promises hold everywhere: an operation never takes longer than
`timeout_s`; a connection problem surfaces as `ControlUnavailable` naming the (password-free)
URL instead of a hang or a driver-specific error; and `healthy` says whether the last operation
reached Redis, which services show on /readyz as "degraded". Recovery needs no action: the
connection pool reconnects on the next operation once Redis is back.

The URL is a plain `redis://` one or a `redis+sentinel://` one (`sentinel.py`): then the client
follows the primary across failovers, and `replicated()` runs a write together with `WAIT` on
the same connection, so a lease write counts only once `min_replicas` replicas hold it (a write
that only a primary that then died ever held would otherwise be granted a second time).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from slipstream.control.sentinel import SentinelClient, is_sentinel_url, parse_sentinel_url
from slipstream.telemetry.metrics import REGISTRY

T = TypeVar("T")

log = structlog.get_logger("slipstream.control")

UP = REGISTRY.gauge("control/redis/up", "1 while the last control-plane operation reached Redis, else 0.")
ERRORS = REGISTRY.counter("control/redis/errors", "Control-plane operations that could not reach Redis, by op.")
RECOVERIES = REGISTRY.counter("control/redis/recoveries", "Times Redis became reachable again after a failure.")


class ControlError(Exception):
    """Base class of the control plane's errors."""


class NotReplicated(Exception):
    """A write reached the primary but not `min_replicas` replicas within the wait (it may be lost)."""


class ControlUnavailable(ControlError):
    """Redis could not be reached (refused, reset, or no answer within the timeout)."""

    def __init__(self, url: str, op: str, cause: BaseException) -> None:
        self.url = url
        self.op = op
        detail = str(cause) or type(cause).__name__
        super().__init__(f"control plane Redis at {url} unavailable during {op}: {detail}")


def redact_url(url: str) -> str:
    """The URL without its password, safe for logs and error messages."""
    if is_sentinel_url(url):
        return parse_sentinel_url(url).redacted()
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    user = parts.username or ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}", parts.path, parts.query, parts.fragment))


class ControlClient:
    """One Redis connection pool with bounded operations and a `healthy` flag.

    `call(op, fn)` runs `fn(redis)` under `timeout_s` and maps every connection failure to
    `ControlUnavailable`. Errors Redis itself returns (a wrong type, a script error) are bugs, not
    outages: they propagate unchanged and leave `healthy` alone.
    """

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.url = redact_url(url)
        self.timeout_s = timeout_s
        # One quick retry without backoff: after a Redis restart the pooled socket is dead and the
        # retry reconnects, so the first operation after recovery succeeds. Only connection
        # errors are retried (a timed-out write may have been applied; repeating it could double
        # an increment).
        options: dict[str, Any] = {
            "socket_timeout": timeout_s,
            "socket_connect_timeout": timeout_s,
            "retry": Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            "decode_responses": True,
        }
        self.min_replicas = 0
        """Replicas that must acknowledge a `replicated()` write (a Sentinel URL's `min_replicas`)."""
        self._sentinel: SentinelClient | None = None
        if is_sentinel_url(url):
            target = parse_sentinel_url(url)  # ValueError names what is wrong
            self.min_replicas = target.min_replicas
            self._sentinel = SentinelClient(target, **options)
            self.redis: aioredis.Redis = self._sentinel.primary
        else:
            self.redis = aioredis.Redis.from_url(url, **options)
        self.healthy = True
        self.last_error: str | None = None
        self.failures = 0
        UP.set(1)

    def script(self, source: str) -> Any:
        """A registered Lua script (EVALSHA, reloaded by redis-py after a Redis restart)."""
        return self.redis.register_script(source)

    async def call(self, op: str, fn: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
        """`fn(redis)` bounded by `timeout_s`; connection failures raise `ControlUnavailable`."""
        try:
            result = await asyncio.wait_for(fn(self.redis), self.timeout_s)
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
            self._failed(op, exc)
            raise ControlUnavailable(self.url, op, exc) from exc
        self._succeeded()
        return result

    async def replicated(self, op: str, script: Any, keys: list[str], args: list[Any]) -> Any:
        """Run a registered `script` and, with `min_replicas`, `WAIT` for that many replicas on the same
        connection; `ControlUnavailable` (cause `NotReplicated`) when fewer acknowledged in time."""
        if self.min_replicas == 0:
            return await self.call(op, lambda r: script(keys=keys, args=args))
        wait_ms = max(1, int(self.timeout_s * 500))  # half the budget: the answer must still come in time

        async def run(r: aioredis.Redis) -> list[Any]:
            pipe = r.pipeline(transaction=False)
            await script(keys=keys, args=args, client=pipe)
            pipe.execute_command("WAIT", self.min_replicas, wait_ms)
            return list(await pipe.execute())

        result, acked = await self.call(op, run)
        if int(acked) < self.min_replicas:
            exc = NotReplicated(f"{acked} of {self.min_replicas} replica(s) acknowledged within {wait_ms} ms")
            self._failed(op, exc)
            raise ControlUnavailable(self.url, op, exc) from exc
        return result

    async def ping(self) -> None:
        """Round trip to Redis; raises `ControlUnavailable` when it is not reachable."""
        await self.call("ping", lambda r: r.ping())

    async def close(self) -> None:
        if self._sentinel is not None:
            await self._sentinel.close()
        else:
            await self.redis.aclose()

    def _failed(self, op: str, exc: BaseException) -> None:
        ERRORS.add(op=op)
        self.failures += 1
        self.last_error = f"{op}: {exc or type(exc).__name__}"
        if self.healthy:
            log.warning("control plane unavailable", url=self.url, op=op, error=str(exc) or type(exc).__name__)
        self.healthy = False
        UP.set(0)

    def _succeeded(self) -> None:
        if not self.healthy:
            RECOVERIES.add()
            log.info("control plane reachable again", url=self.url, failures=self.failures)
        self.healthy = True
        self.last_error = None
        UP.set(1)
