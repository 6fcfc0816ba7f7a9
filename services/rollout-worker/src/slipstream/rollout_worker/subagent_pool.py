"""The pool's work: play sub-agent requests on the pinned engine and answer each requester's inbox.

A worker with `[pool] subagents = true` takes `SubagentRequest`s from the shared durable
`subagent-pool` (stream SUBAGENTS) through the same bounded intake as tasks (intake.py: never more
than `max_in_flight` held, an in-progress signal on each while it plays), rebuilds the child env
and task from the request (libs/harness subagents.py), plays it on the engine pinned to one
version, and publishes the `SubagentReply` on core NATS to the inbox named in the request's
`Slipstream-Reply-To` header. Then it acks.

Every path settles the request once:

- ok: played and answered;
- replayed: this worker already answered (or is playing) that request id, a retry of the requester
  that reached the same worker: answered from memory, the child is not played twice;
- error: the request can never be served here (unknown env, bad options or split, a prompt too
  long for the engine) or the play failed: answered with `error` (the requester masks the
  episode) and acked, since another replica would fail the same way;
- expired: past its deadline, nobody waits for it: acked without playing;
- no_reply_to: no inbox to answer: dead-lettered by term (it can never be answered);
- released: the engine aborted (the worker is stopping): handed back for another replica.

An `EngineError` (the engine loop died) is fatal, as in the task pipeline.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, OrderedDict
from typing import TYPE_CHECKING, Any

import msgspec

from slipstream.bus import Delivery
from slipstream.engine.driver import EngineError
from slipstream.engine.interface import Engine
from slipstream.engine.tokenizer import Tokenizer
from slipstream.envs import EnvError
from slipstream.harness import RolloutAborted, TaskRejected, play_subagent
from slipstream.rollout_worker.instruments import SUBAGENT_S, SUBAGENTS
from slipstream.schemas import SubagentReply, SubagentRequest
from slipstream.schemas.codec import SCHEMA_HEADER, encode, schema_header
from slipstream.schemas.subagents import REPLY_TO_HEADER
from slipstream.telemetry.logs import get_logger

if TYPE_CHECKING:
    from nats.aio.client import Client

log = get_logger(__name__)


class SubagentServer:
    """The per-request handler the intake runs in a pool worker; see the module docstring."""

    def __init__(
        self,
        nc: Client,
        engine: Engine,
        tokenizer: Tokenizer,
        *,
        worker_id: str,
        tools: Any = None,
        replay_cache: int = 1024,
    ) -> None:
        self.nc = nc
        self.engine = engine
        self.tokenizer = tokenizer
        self.worker_id = worker_id
        self.tools = tools
        self.replay_cache = replay_cache
        self._done: OrderedDict[str, SubagentReply] = OrderedDict()
        self._playing: dict[str, asyncio.Future[SubagentReply]] = {}
        self._envs: dict[str, Any] = {}  # child environments by name + options, built once
        self.outcomes: Counter[str] = Counter()
        self.failed = asyncio.Event()
        self.fatal: BaseException | None = None

    async def handle(self, delivery: Delivery[SubagentRequest]) -> None:
        request = delivery.msg
        inbox = (delivery.headers or {}).get(REPLY_TO_HEADER, "")
        if not inbox:
            log.warning("sub-agent request without a reply inbox; dropped", request_id=request.request_id)
            await self._settle("no_reply_to", delivery, "term")
            return
        if request.deadline and time.time() > request.deadline:
            await self._settle("expired", delivery, "ack")
            return
        replayed = request.request_id in self._done or request.request_id in self._playing
        try:
            reply = await self._reply(request)
        except RolloutAborted:
            await self._settle("released", delivery, "release")
            return
        except EngineError as exc:
            self.fatal = exc
            self.failed.set()
            log.error("engine failed; handing the sub-agent request back", request_id=request.request_id)
            await self._settle("released", delivery, "release")
            return
        if replayed:
            reply = msgspec.structs.replace(reply, replayed=True)
        await self._answer(inbox, reply)
        await self._settle("replayed" if replayed else ("error" if reply.error else "ok"), delivery, "ack")

    async def _reply(self, request: SubagentRequest) -> SubagentReply:
        """The reply to `request`: remembered, joined while it plays, or played now."""
        done = self._done.get(request.request_id)
        if done is not None:
            return done
        playing = self._playing.get(request.request_id)
        if playing is not None:
            return await asyncio.shield(playing)
        future: asyncio.Future[SubagentReply] = asyncio.get_running_loop().create_future()
        self._playing[request.request_id] = future
        try:
            reply = await self._play(request)
        except BaseException as exc:
            future.set_exception(exc)
            future.exception()  # retrieved: a joined retry re-raises it, nobody else must
            raise
        finally:
            self._playing.pop(request.request_id, None)
        future.set_result(reply)
        self._remember(reply)
        return reply

    async def _play(self, request: SubagentRequest) -> SubagentReply:
        t0 = time.perf_counter()
        try:
            reply = await play_subagent(
                self.engine,
                self.tokenizer,
                request,
                worker_id=self.worker_id,
                tools=self.tools,
                max_seq_len=_max_seq_len(self.engine),
                envs=self._envs,
            )
        except (EnvError, TaskRejected, ValueError) as exc:
            log.warning("sub-agent request cannot be served", request_id=request.request_id, error=str(exc))
            return self._error(request, f"rejected by the pool: {exc}")
        except (RolloutAborted, EngineError):
            raise
        except Exception as exc:  # a crashing env: answered as an infra error, logged with its cause
            log.error("sub-agent play failed", request_id=request.request_id, error=repr(exc), exc_info=True)
            return self._error(request, f"sub-agent play failed: {exc!r}")
        SUBAGENT_S.observe(time.perf_counter() - t0)
        return reply

    def _error(self, request: SubagentRequest, why: str) -> SubagentReply:
        return SubagentReply(
            request_id=request.request_id,
            error=why,
            worker_id=self.worker_id,
            policy_version=self.engine.policy_version,
        )

    def _remember(self, reply: SubagentReply) -> None:
        if self.replay_cache <= 0:
            return
        self._done[reply.request_id] = reply
        while len(self._done) > self.replay_cache:
            self._done.popitem(last=False)

    async def _answer(self, inbox: str, reply: SubagentReply) -> None:
        data = encode(reply)
        if len(data) > self.nc.max_payload:
            reply = SubagentReply(
                request_id=reply.request_id,
                error=f"reply of {len(data)} bytes is over the bus limit of {self.nc.max_payload}",
                worker_id=self.worker_id,
                policy_version=reply.policy_version,
            )
            data = encode(reply)
        try:
            await self.nc.publish(inbox, data, headers={SCHEMA_HEADER: schema_header(SubagentReply)})
        except Exception as exc:  # the requester times out and sends again; the replay answers it
            log.warning("could not send a sub-agent reply", request_id=reply.request_id, error=repr(exc))

    async def _settle(self, outcome: str, delivery: Delivery[SubagentRequest], action: str) -> None:
        self.outcomes[outcome] += 1
        SUBAGENTS.add(outcome=outcome)
        try:
            if action == "ack":
                await delivery.ack()
            elif action == "term":
                await delivery.term()
            else:
                await delivery.release()
        except Exception as exc:  # the server redelivers after ack_wait; the replay cache answers it
            log.warning("could not settle a sub-agent request", outcome=outcome, error=repr(exc))

    def status(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "policy_version": self.engine.policy_version,
            "playing": len(self._playing),
            "remembered": len(self._done),
            **self.outcomes,
        }


def _max_seq_len(engine: Engine) -> int | None:
    value = getattr(engine, "max_seq_len", None)
    return value if isinstance(value, int) else None
