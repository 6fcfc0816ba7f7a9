"""The idempotency ledger: which trajectories a learner step has already counted.

JetStream delivers at least once: a trajectory comes back after a learner crash, a nak or an
ack that got lost. The ledger makes each trajectory count once. One key per trajectory id,
`slipstream:{run}:ledger:<id>` = the step that counted it, set-if-absent with a TTL that must
outlive any redelivery (JetStream's max_deliver x ack_wait, plus downtime).

How the learner uses it with its checkpoint (the step commit):

1. intake: drop trajectories for which `counted(ids)` is True (ack them, count them as
   duplicates);
2. train step S on the rest;
3. commit step S: write what makes S durable (the checkpoint, or the step record that lists the
   ids), then `claim(ids, S)`; an id answered False was counted by someone else in between
   (only possible without the lease) and is logged and counted, not trained twice;
4. ack the messages.

A crash before 3 leaves no trace: the messages are redelivered and the resumed learner trains on
them once. A crash between 3 and 4 leaves them claimed: the redelivered copies are dropped at 1.
A crash inside 3 (durable state written, claim not done), and Redis losing its data, are both
covered at startup: the learner calls `mark(ids_of_last_checkpoint, step)` before consuming.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from slipstream.control.client import ControlClient
from slipstream.control.keyspace import Keyspace
from slipstream.telemetry.metrics import REGISTRY

CLAIMS = REGISTRY.counter(
    "control/ledger/claims", "Trajectory ids claimed by learner steps, by result (first|duplicate)."
)
RESTORED = REGISTRY.counter("control/ledger/restored", "Ids re-marked from a checkpoint that the ledger had lost.")

DEFAULT_TTL_S = 7 * 24 * 3600.0
# Bounds the time one Lua call blocks Redis (about 1 µs per SET); claims are idempotent, so a
# batch split over several calls is still counted once even if a call fails half-way.
CHUNK = 2000

# KEYS: ledger keys. ARGV: step, ttl_ms. -> {1|0 per key}: 1 = newly claimed.
_CLAIM = """
local out = {}
for i, key in ipairs(KEYS) do
  if redis.call('SET', key, ARGV[1], 'NX', 'PX', ARGV[2]) then out[i] = 1 else out[i] = 0 end
end
return out
"""


class Ledger:
    """Trajectory ids counted by this run's learner steps, each with a TTL."""

    def __init__(self, client: ControlClient, run_id: str, *, ttl_s: float = DEFAULT_TTL_S) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ledger ttl_s must be > 0, got {ttl_s}")
        self.client = client
        self.keys = Keyspace(run_id)
        self.ttl_s = ttl_s
        self._claim = client.script(_CLAIM)

    def _keys_of(self, ids: Sequence[str]) -> list[str]:
        if isinstance(ids, str):
            raise TypeError("ledger ids must be a list of trajectory ids, not one string")
        bad = [i for i in ids if not isinstance(i, str) or not i]
        if bad:
            raise ValueError(f"ledger ids must be non-empty strings; got {bad[:3]!r}")
        return [self.keys.ledger(i) for i in ids]

    async def _claim_chunk(self, keys: list[str], args: list[int], redis: Any) -> Any:
        return await self._claim(keys=keys, args=args)

    async def claim(self, ids: Sequence[str], step: int) -> list[bool]:
        """Record `ids` as counted by `step`: per id, True the first time, False if already counted.

        An id repeated inside `ids` is True once, then False.
        """
        out = await self._set_absent("ledger.claim", ids, step)
        first = sum(out)
        if first:
            CLAIMS.add(first, result="first")
        if len(out) - first:
            CLAIMS.add(len(out) - first, result="duplicate")
        return out

    async def mark(self, ids: Sequence[str], step: int) -> int:
        """Restore ids known to be counted (e.g. from the last checkpoint); returns how many were missing.

        Ids already present keep the step that first counted them.
        """
        restored = sum(await self._set_absent("ledger.mark", ids, step))
        if restored:
            RESTORED.add(restored)
        return restored

    async def _set_absent(self, op: str, ids: Sequence[str], step: int) -> list[bool]:
        keys = self._keys_of(ids)
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        ttl_ms = max(1, int(self.ttl_s * 1000))
        out: list[bool] = []
        for lo in range(0, len(keys), CHUNK):
            flags = await self.client.call(op, partial(self._claim_chunk, keys[lo : lo + CHUNK], [step, ttl_ms]))
            out.extend(int(f) == 1 for f in flags)
        return out

    async def counted(self, ids: Sequence[str]) -> list[bool]:
        """Per id: has a step counted it already?"""
        keys = self._keys_of(ids)
        out: list[bool] = []
        for lo in range(0, len(keys), CHUNK):
            values = await self.client.call("ledger.counted", partial(_mget, keys[lo : lo + CHUNK]))
            out.extend(v is not None for v in values)
        return out

    async def is_counted(self, trajectory_id: str) -> bool:
        return (await self.counted([trajectory_id]))[0]

    async def step_of(self, trajectory_id: str) -> int | None:
        """The step that counted `trajectory_id`, or None."""
        key = self._keys_of([trajectory_id])[0]
        value = await self.client.call("ledger.step_of", lambda r: r.get(key))
        return None if value is None else int(value)


async def _mget(keys: list[str], redis: Any) -> Any:
    return await redis.mget(keys)
