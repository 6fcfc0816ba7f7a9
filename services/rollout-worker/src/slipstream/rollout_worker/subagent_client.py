"""The orchestrator's side of the sub-agent pool: a `SubagentTransport` over NATS JetStream.

`[subagents] transport = "nats"`: a frozen sub-agent becomes a `SubagentRequest` published to
`subagents.<env>` (stream SUBAGENTS, a work queue read by the pool's durable `subagent-pool`), so
the pool's backlog is a consumer lag KEDA scales on. The reply comes back on core NATS to an inbox
this worker opened for the request (header `Slipstream-Reply-To`), never through a stream.

Failure semantics follow the tool-service's (libs/toolcalls remote.py):

- no reply within `timeout_s` (the pool is saturated, a replica died, the stream refused the
  publish): the request is sent again after a short doubling pause, up to `retries` times, with
  the same request id and a new message id (so JetStream's de-duplication does not swallow it);
  a pool worker that already played that request id answers from memory instead of replaying it;
- all attempts wait on the one inbox, so a late reply to an earlier attempt is as good as the
  latest: the requester keeps exactly one reply per request;
- if every attempt fails the reply carries `error`, and the parent episode gets an infra error
  (masked by the learner, never scored as a failure of the model);
- a reply played on another version than `pin_version` (a pool replica pinned to another
  version, or any of its samples' segments off the pin) is rejected: it becomes an error reply
  naming both versions (an infra error on the parent, masked, never trained as the model's
  fault) and is counted (`stats["wrong_version"]`, `worker/subagents/requests{outcome=wrong_version}`).
  It is not retried: the replicas share one durable, so a retry may reach the same replica.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import TYPE_CHECKING

import msgspec

from slipstream.bus import Bus, BusError
from slipstream.rollout_worker.instruments import SUBAGENT_REQUESTS
from slipstream.runtime.backoff import Backoff
from slipstream.schemas import SubagentReply, SubagentRequest
from slipstream.schemas.codec import SCHEMA_HEADER, SchemaError, check_header, decode
from slipstream.schemas.subagents import REPLY_TO_HEADER
from slipstream.schemas.subjects import subagent_subject
from slipstream.telemetry.logs import get_logger

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

log = get_logger(__name__)


class NatsSubagents:
    """Plays frozen sub-agents in the pinned pool; see the module docstring for the semantics."""

    def __init__(
        self,
        bus: Bus,
        *,
        timeout_s: float = 120.0,
        retries: int = 1,
        retry_backoff_s: float = 0.5,
        caller: str = "",
        pin_version: int | None = None,
    ) -> None:
        nc: Client | None = getattr(bus, "nc", None)
        if nc is None:
            raise ValueError("[subagents] transport = 'nats' needs [bus] type = 'nats' (the pool is reached over NATS)")
        if timeout_s <= 0 or retries < 0 or retry_backoff_s < 0:
            raise ValueError(
                f"need timeout_s > 0, retries >= 0, retry_backoff_s >= 0; got {timeout_s}, {retries}, {retry_backoff_s}"
            )
        self._bus = bus
        self._nc = nc
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self.caller = caller
        self.pin_version = pin_version  # None: any version accepted (no pin to hold the pool to)
        self.stats = {"requests": 0, "retries": 0, "unavailable": 0, "errors": 0, "wrong_version": 0}
        # Which pool worker served how many of this worker's sub-agents, and at which versions.
        self.served_by: Counter[str] = Counter()
        self.versions: Counter[int] = Counter()

    async def run(self, request: SubagentRequest) -> SubagentReply:
        self.stats["requests"] += 1
        got: asyncio.Future[SubagentReply] = asyncio.get_running_loop().create_future()

        async def on_reply(msg: Msg) -> None:
            reply = _reply_of(msg.data, msg.headers, request.request_id)
            if reply is not None and not got.done():
                got.set_result(reply)

        inbox = self._nc.new_inbox()
        sub = await self._nc.subscribe(inbox, cb=on_reply)
        failures: list[str] = []
        retry = Backoff(self.retry_backoff_s)
        try:
            for attempt in range(1, self.retries + 2):
                if attempt > 1:
                    self.stats["retries"] += 1
                    SUBAGENT_REQUESTS.add(outcome="retried")
                    await retry.sleep()
                if not got.done():
                    sent = msgspec.structs.replace(
                        request, attempt=attempt, deadline=time.time() + self.timeout_s, caller=self.caller
                    )
                    try:
                        await self._bus.publish(
                            subagent_subject(request.env),
                            sent,
                            msg_id=f"{request.request_id}#{attempt}",
                            headers={REPLY_TO_HEADER: inbox},
                        )
                    except BusError as exc:
                        failures.append(f"publish refused: {exc}")
                        continue
                try:
                    reply = await asyncio.wait_for(asyncio.shield(got), self.timeout_s)
                except TimeoutError:
                    failures.append(f"no reply within {self.timeout_s:g} s")
                    continue
                if reply.error:
                    self.stats["errors"] += 1
                else:
                    self.served_by[reply.worker_id] += 1
                    self.versions[reply.policy_version] += 1
                    off = off_pin(reply, self.pin_version)
                    if off is not None:
                        self.stats["wrong_version"] += 1
                        SUBAGENT_REQUESTS.add(outcome="wrong_version")
                        log.warning(
                            "sub-agent reply from another version rejected",
                            request_id=request.request_id,
                            worker=reply.worker_id,
                            error=off,
                        )
                        return SubagentReply(request_id=request.request_id, error=off, worker_id=reply.worker_id)
                SUBAGENT_REQUESTS.add(outcome="ok")
                return reply
        finally:
            got.cancel()
            await sub.unsubscribe()
        self.stats["unavailable"] += 1
        SUBAGENT_REQUESTS.add(outcome="unavailable")
        log.warning("sub-agent pool unavailable", request_id=request.request_id, failures=failures)
        return SubagentReply(
            request_id=request.request_id,
            error=f"sub-agent pool unavailable after {self.retries + 1} attempt(s) ({'; '.join(failures)})",
        )


def off_pin(reply: SubagentReply, pin: int | None) -> str | None:
    """Why `reply` was not played on version `pin` (None when it was, or when nothing is pinned)."""
    if pin is None:
        return None
    seen = {reply.policy_version} | {seg.policy_version for s in reply.samples for seg in s.segments}
    if seen == {pin}:
        return None
    return (
        f"sub-agent pool worker {reply.worker_id or '?'} played on version(s) {sorted(seen)}, but this worker's "
        f"sub-agents are pinned to version {pin}: reply rejected"
    )


def _reply_of(data: bytes, headers: dict[str, str] | None, request_id: str) -> SubagentReply | None:
    """The reply, or None when it is not a `SubagentReply` for this request (treated as no reply)."""
    try:
        check_header((headers or {}).get(SCHEMA_HEADER), SubagentReply)
        reply = decode(data, SubagentReply)
    except SchemaError:
        return None
    return reply if reply.request_id == request_id else None
