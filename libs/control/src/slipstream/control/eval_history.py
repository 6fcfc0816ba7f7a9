"""Eval history and the promoted version, kept in Redis so any restart finds them.

Eval-gate records every `EvalResult` (a list in order, plus a hash by policy_version for the
latest result of each version) and moves the promoted pointer. Promotions form a stack: each
promote pushes, `rollback()` pops and returns to the version promoted before. Pointer, stack
and an audit log of `Promotion` records change together in one Lua script, so a crash never
leaves the pointer and the stack disagreeing. Values are msgspec JSON, readable with redis-cli.
"""

from __future__ import annotations

import time
from typing import Any

import msgspec

from slipstream.control.client import ControlClient
from slipstream.control.keyspace import Keyspace
from slipstream.schemas import EvalResult


class Promotion(msgspec.Struct, kw_only=True):
    """One change of the promoted pointer (audit log entry)."""

    action: str  # "promote" | "rollback"
    version: int | None  # promoted after the change (None: nothing promoted any more)
    previous: int | None  # promoted before the change
    reason: str = ""
    at: float = 0.0  # unix time


# KEYS: promoted, stack, log. ARGV: version, reason, at. -> previous (nil if none).
# Promoting the version already promoted changes nothing (a redelivered decision).
_PROMOTE = """
local prev = redis.call('GET', KEYS[1])
if prev == ARGV[1] then return prev end
redis.call('SET', KEYS[1], ARGV[1])
redis.call('RPUSH', KEYS[2], ARGV[1])
redis.call('RPUSH', KEYS[3], cjson.encode({action='promote', version=tonumber(ARGV[1]),
  previous=prev and tonumber(prev) or cjson.null, reason=ARGV[2], at=tonumber(ARGV[3])}))
return prev
"""
# KEYS: promoted, stack, log. ARGV: reason, at. -> the version promoted now (nil if none).
_ROLLBACK = """
local cur = redis.call('RPOP', KEYS[2])
if not cur then return false end
local prev = redis.call('LINDEX', KEYS[2], -1)
if prev then redis.call('SET', KEYS[1], prev) else redis.call('DEL', KEYS[1]) end
redis.call('RPUSH', KEYS[3], cjson.encode({action='rollback', version=prev and tonumber(prev) or cjson.null,
  previous=tonumber(cur), reason=ARGV[1], at=tonumber(ARGV[2])}))
return prev
"""

_eval_decoder = msgspec.json.Decoder(EvalResult)
_promotion_decoder = msgspec.json.Decoder(Promotion)


def _version(value: Any) -> int | None:
    return None if value is None else int(value)


class EvalHistory:
    """The run's evaluations and its promoted version."""

    def __init__(self, client: ControlClient, run_id: str) -> None:
        self.client = client
        self.keys = Keyspace(run_id)
        self._promote = client.script(_PROMOTE)
        self._rollback = client.script(_ROLLBACK)

    @property
    def _pointer_keys(self) -> list[str]:
        return [self.keys.promoted, self.keys.promotion_stack, self.keys.promotion_log]

    async def record(self, result: EvalResult) -> None:
        """Append `result` to the history; it becomes the result `get(result.policy_version)` returns."""
        if not isinstance(result, EvalResult):
            raise TypeError(f"record() takes an EvalResult, got {type(result).__name__}")
        data = msgspec.json.encode(result).decode()

        async def run(r: Any) -> None:
            async with r.pipeline(transaction=True) as pipe:
                pipe.rpush(self.keys.evals, data)
                pipe.hset(self.keys.evals_by_version, str(result.policy_version), data)
                await pipe.execute()

        await self.client.call("evals.record", run)

    async def get(self, version: int) -> EvalResult | None:
        """The latest recorded evaluation of `version`, or None."""
        data = await self.client.call("evals.get", lambda r: r.hget(self.keys.evals_by_version, str(version)))
        return None if data is None else _eval_decoder.decode(data)

    async def history(self, limit: int = 100) -> list[EvalResult]:
        """The last `limit` evaluations, oldest first."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        rows = await self.client.call("evals.history", lambda r: r.lrange(self.keys.evals, -limit, -1))
        return [_eval_decoder.decode(row) for row in rows]

    async def promoted(self) -> int | None:
        """The promoted policy_version, or None before the first promotion."""
        return _version(await self.client.call("evals.promoted", lambda r: r.get(self.keys.promoted)))

    async def promote(self, version: int, reason: str = "") -> int | None:
        """Make `version` the promoted one; returns the version promoted before (None if none).

        Promoting the version that is already promoted is a no-op and returns that version.
        """
        if not isinstance(version, int) or version < 0:
            raise ValueError(f"version must be an int >= 0, got {version!r}")
        prev = await self.client.call(
            "evals.promote",
            lambda r: self._promote(keys=self._pointer_keys, args=[str(version), reason, repr(time.time())]),
        )
        return _version(prev)

    async def rollback(self, reason: str = "") -> int | None:
        """Return to the version promoted before the current one; returns it (None: none left).

        With nothing promoted, nothing changes and None is returned.
        """
        now = await self.client.call(
            "evals.rollback", lambda r: self._rollback(keys=self._pointer_keys, args=[reason, repr(time.time())])
        )
        return _version(now)

    async def promotion_stack(self) -> list[int]:
        """Promoted versions, oldest first; the last is the promoted one."""
        rows = await self.client.call("evals.stack", lambda r: r.lrange(self.keys.promotion_stack, 0, -1))
        return [int(v) for v in rows]

    async def promotions(self, limit: int = 100) -> list[Promotion]:
        """The last `limit` pointer changes, oldest first."""
        if limit < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        rows = await self.client.call("evals.promotions", lambda r: r.lrange(self.keys.promotion_log, -limit, -1))
        return [_promotion_decoder.decode(row) for row in rows]
