"""The promoted pointer: move it in Redis, then tell serving workers on `weights.promoted`.

One code path for the gate's automatic promotions and the operator's `slipstream promote` and
`slipstream rollback`: Redis (`EvalHistory`) is the truth, read after any restart; the
`weights.promoted` message is how serving workers (`[worker] follow = "promoted"`) learn of it
within a moment, a rollback included (the message then names an older version, and serving
workers move back to it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from slipstream.bus import Bus
from slipstream.control import EvalHistory
from slipstream.schemas import WeightsPromoted
from slipstream.schemas.subjects import WEIGHTS_PROMOTED
from slipstream.telemetry.logs import get_logger

log = get_logger(__name__)


class PointerError(Exception):
    """The pointer cannot move as asked (nothing to roll back to)."""


@dataclass(frozen=True)
class Moved:
    """The pointer after a change: `version` is promoted now, `previous` was before."""

    version: int
    previous: int | None
    message: WeightsPromoted
    changed: bool = True  # False: `version` was promoted already (only announced again)


async def announce(
    bus: Bus,
    *,
    run_id: str,
    version: int,
    manifest_key: str,
    previous: int | None,
    reason: str,
    msg_id: str | None = None,
) -> WeightsPromoted:
    """Publish `weights.promoted` for `version`. `msg_id` makes a repeat a no-op (JetStream dedup);
    without one every call is a new message (an operator's action)."""
    msg = WeightsPromoted(
        policy_version=version,
        manifest_key=manifest_key,
        previous_version=previous,
        reason=reason,
        run_id=run_id,
        promoted_at=time.time(),
    )
    await bus.publish(WEIGHTS_PROMOTED, msg, msg_id=msg_id or f"{run_id}:promoted:{uuid.uuid4().hex}")
    log.info("weights.promoted published", policy_version=version, previous_version=previous, reason=reason)
    return msg


async def promote(
    evals: EvalHistory,
    bus: Bus,
    *,
    run_id: str,
    version: int,
    manifest_key: str,
    reason: str,
    idempotent: bool = False,
) -> Moved:
    """Make `version` the promoted one (Redis first), then announce it.

    Promoting the version already promoted changes nothing in Redis and announces it again, with
    the version promoted before it as `previous`. With `idempotent` the message id is
    `<run>:promoted:<version>:after:<previous>`, the same on every repeat of one decision (the
    gate's redeliveries), so the stream keeps one copy; otherwise every call is a new message.
    """
    before = await evals.promote(version, reason=reason)
    previous = before
    if before == version:
        stack = await evals.promotion_stack()
        previous = stack[-2] if len(stack) > 1 else None
    msg_id = f"{run_id}:promoted:{version}:after:{previous}" if idempotent else None
    msg = await announce(
        bus, run_id=run_id, version=version, manifest_key=manifest_key, previous=previous, reason=reason, msg_id=msg_id
    )
    return Moved(version, previous, msg, changed=before != version)


async def rollback(
    evals: EvalHistory, bus: Bus, *, run_id: str, manifest_key_of: Callable[[int], str], reason: str
) -> Moved:
    """Go back to the version promoted before the current one and announce it.

    Raises PointerError, changing nothing, when fewer than two versions were promoted (there is
    nothing to go back to, and serving workers must not be left without a version).
    """
    stack = await evals.promotion_stack()
    if len(stack) < 2:
        what = f"only v{stack[-1]} was promoted" if stack else "nothing is promoted"
        raise PointerError(f"nothing to roll back to: {what}")
    current = stack[-1]
    now = await evals.rollback(reason=reason)
    if now is None:  # emptied concurrently by another rollback
        raise PointerError("nothing to roll back to: the promotion stack was emptied meanwhile")
    msg = await announce(
        bus, run_id=run_id, version=now, manifest_key=manifest_key_of(now), previous=current, reason=reason
    )
    return Moved(now, current, msg)
