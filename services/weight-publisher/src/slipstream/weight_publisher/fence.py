"""The fence: a staged version is stored and announced only while the learner that staged it leads the run.

With a control plane, the learner writes its lease holder id and fencing token into each staged
file's metadata (`lease_holder`, `fence_token`). Right before storing a version, and again right
before announcing it, the publisher reads the run's leader lease from Redis (one atomic GET+PTTL)
and decides (`verdict`, a pure function):

- no fence in the file (a learner without a control plane): publish, as without Redis;
- the lease is held by that holder, under that token or a later one of the same holder (it took
  its own lapsed lease back after checking nobody else held it), with more than
  `min_remaining_s` left: publish;
- the lease is held by another holder (or that holder under a lower token): **fenced** — the
  version is discarded, never stored or announced, and counted;
- nobody holds the lease, it is about to lapse, or Redis cannot be asked: **wait** — retried
  with the usual back-off, so an outage delays announces and never lets one through unchecked.

The check and the announce are still two steps (milliseconds apart, in a process that does not
train), so the announce carries the staged token (`WeightAnnounce.fence_token`) and its
consumers ignore one below the highest token they have seen (slipstream.control README,
"Fencing gap").
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from slipstream.control import Control, ControlUnavailable, LeaseInfo
from slipstream.telemetry.metrics import counter

FENCE_TOKEN_KEY = "fence_token"
"""Staged-file metadata key of the fencing token (the learner writes the same key)."""
LEASE_HOLDER_KEY = "lease_holder"
"""Staged-file metadata key of the lease holder id."""
OBSERVER = "weight-publisher"
"""Holder id of the publisher's read-only view of the lease (it never acquires it)."""

FENCED = counter("publisher/fence/fenced", "Staged versions discarded because their learner no longer leads the run.")
WAITS = counter("publisher/fence/waits", "Publishes postponed by the fence check (label reason).")


class Verdict(enum.Enum):
    PUBLISH = "publish"
    WAIT = "wait"
    FENCED = "fenced"


@dataclass(frozen=True)
class StagedFence:
    """Who staged a version, under which fencing token."""

    holder: str
    token: int


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    reason: str


class FenceWait(Exception):
    """The version cannot be published yet (lease vacant or about to lapse, Redis away): retry later."""


class Fenced(Exception):
    """The version's learner no longer leads the run: discard the staged file, never announce it."""


def read_fence(path: str | Path) -> StagedFence | None:
    """The fence in a staged file's metadata, or None when the learner staged without one."""
    with safe_open(str(path), framework="pt") as fh:
        meta = fh.metadata() or {}
    token, holder = meta.get(FENCE_TOKEN_KEY, ""), meta.get(LEASE_HOLDER_KEY, "")
    if not token and not holder:
        return None
    if not token.isdigit() or not holder:
        raise ValueError(
            f"staged file {path} has a malformed fence: {FENCE_TOKEN_KEY}={token!r}, {LEASE_HOLDER_KEY}={holder!r}"
        )
    return StagedFence(holder, int(token))


def verdict(fence: StagedFence | None, lease: LeaseInfo | None, *, min_remaining_s: float) -> Decision:
    """Whether a version staged under `fence` may be published while the run's lease is `lease`."""
    if fence is None:
        return Decision(Verdict.PUBLISH, "unfenced")
    if lease is None:
        return Decision(Verdict.WAIT, "lease_vacant")
    if lease.holder != fence.holder:
        return Decision(Verdict.FENCED, f"lease held by {lease.holder!r} (token {lease.token}), not {fence.holder!r}")
    if lease.token < fence.token:
        return Decision(Verdict.FENCED, f"lease token {lease.token} is below the staged token {fence.token}")
    if lease.remaining_s <= min_remaining_s:
        return Decision(Verdict.WAIT, "lease_expiring")
    return Decision(Verdict.PUBLISH, "leader")


class Fence:
    """The publisher's fence check against the run's leader lease in Redis."""

    def __init__(self, control: Control, *, min_remaining_s: float) -> None:
        self.control = control
        self.min_remaining_s = min_remaining_s
        self._lease = control.lease(OBSERVER)

    async def admit(self, fence: StagedFence | None, version: int) -> None:
        """Return when `version` may go on; raise `FenceWait` (retry later) or `Fenced` (discard it)."""
        if fence is None:
            return
        try:
            current = await self._lease.current()
        except ControlUnavailable as exc:
            WAITS.add(1, reason="redis_unavailable")
            raise FenceWait(f"version {version}: the control plane is unreachable ({exc})") from exc
        decision = verdict(fence, current, min_remaining_s=self.min_remaining_s)
        if decision.verdict is Verdict.WAIT:
            WAITS.add(1, reason=decision.reason)
            raise FenceWait(f"version {version}: {decision.reason}")
        if decision.verdict is Verdict.FENCED:
            FENCED.add(1)
            raise Fenced(
                f"version {version} was staged by {fence.holder!r} under token {fence.token}: {decision.reason}"
            )
