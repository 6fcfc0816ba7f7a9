"""Creating (or updating) JetStream streams and durable consumers from the topology.

Safe to run from every replica at once: a stream or consumer whose configuration already matches
the table is only read (stream/consumer info, which every service's NATS user may do), a missing
one is created, a stream whose configuration drifted is updated, and a consumer with a changed
configuration is updated (nats-server ≥ 2.10). Creating and updating are the admin's rights
(`slipstream.bus.permissions`): a service connected as its own user that finds a stream missing
or drifted says so and asks for provisioning instead of waiting on a refused request. A
JetStream that is still starting answers 503; that is retried for a few seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig

from slipstream.bus.base import BusError
from slipstream.bus.config import BusConfig
from slipstream.bus.topology import Topology, server_max_deliver
from slipstream.runtime.backoff import Backoff
from slipstream.schemas.subjects import ConsumerSpec, StreamSpec

log = logging.getLogger(__name__)
_STREAM_DRIFT = 10058  # "stream name already in use with a different configuration"
_RETENTION = {
    "workqueue": RetentionPolicy.WORK_QUEUE,
    "limits": RetentionPolicy.LIMITS,
    "interest": RetentionPolicy.INTEREST,
}
_ATTEMPTS = 8


def stream_config(spec: StreamSpec, subjects: list[str], cfg: BusConfig) -> StreamConfig:
    return StreamConfig(
        name=spec.name,
        description=spec.description or None,
        subjects=subjects,
        retention=_RETENTION[spec.retention],
        storage=StorageType.FILE if cfg.stream_storage == "file" else StorageType.MEMORY,
        num_replicas=cfg.stream_replicas,
        max_age=spec.max_age_s,
        max_bytes=spec.max_bytes,
        duplicate_window=spec.duplicate_window_s,
    )


def consumer_config(spec: ConsumerSpec) -> ConsumerConfig:
    return ConsumerConfig(
        name=spec.durable,
        durable_name=spec.durable,
        filter_subject=spec.filter_subject,
        ack_policy=AckPolicy.EXPLICIT,
        deliver_policy=DeliverPolicy.ALL,
        ack_wait=spec.ack_wait_s,
        max_deliver=server_max_deliver(spec),
        max_ack_pending=spec.max_ack_pending,
    )


async def _with_retries(what: str, op: Callable[[], Awaitable[None]]) -> None:
    retry = Backoff(0.1, max_s=2.0)
    for attempt in range(1, _ATTEMPTS + 1):
        try:
            await op()
            return
        except (nats.js.errors.ServiceUnavailableError, nats.errors.TimeoutError, nats.errors.NoRespondersError) as exc:
            if attempt == _ATTEMPTS:
                raise BusError(f"cannot {what}: JetStream did not answer after {attempt} attempts ({exc!r})") from exc
            delay = next(retry)
            log.info("%s: JetStream not ready (%r); retrying in %.1fs", what, exc, delay)
            await asyncio.sleep(delay)


def _same_stream(have: StreamConfig, want: StreamConfig) -> bool:
    return (
        sorted(have.subjects or []) == sorted(want.subjects or [])
        and have.retention == want.retention
        and have.storage == want.storage
        and (have.num_replicas or 1) == (want.num_replicas or 1)
        and float(have.max_age or 0) == float(want.max_age or 0)
        and (have.max_bytes if have.max_bytes is not None else -1) == want.max_bytes
        and float(have.duplicate_window or 0) == float(want.duplicate_window or 0)
        and (have.description or None) == (want.description or None)
    )


def _same_consumer(have: ConsumerConfig, want: ConsumerConfig) -> bool:
    return (
        have.filter_subject == want.filter_subject
        and have.ack_policy == want.ack_policy
        and have.deliver_policy == want.deliver_policy
        and float(have.ack_wait or 0) == float(want.ack_wait or 0)
        and have.max_deliver == want.max_deliver
        and have.max_ack_pending == want.max_ack_pending
    )


def _needs_admin(what: str) -> BusError:
    return BusError(
        f"{what}; this bus user may not create or update streams and consumers: provision them as the admin "
        "user first (python -m slipstream.bus.provision, or the deploy's provision-streams Job)"
    )


async def ensure_stream(
    js: JetStreamContext, spec: StreamSpec, subjects: list[str], cfg: BusConfig, *, admin: bool = True
) -> None:
    sc = stream_config(spec, subjects, cfg)

    async def add_or_update() -> None:
        try:
            have = (await js.stream_info(spec.name)).config
        except nats.js.errors.NotFoundError:
            have = None
        if have is not None and _same_stream(have, sc):
            return
        if not admin:
            state = "is missing" if have is None else "differs from the subject table"
            raise _needs_admin(f"stream {spec.name} {state}")
        try:
            await js.add_stream(sc)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code != _STREAM_DRIFT:
                raise BusError(f"cannot create stream {spec.name}: {exc.description}") from exc
            log.info("stream %s exists with another configuration; updating it", spec.name)
            try:
                await js.update_stream(sc)
            except nats.js.errors.BadRequestError as exc2:
                raise BusError(
                    f"stream {spec.name} exists with a configuration that cannot be updated to the table's "
                    f"({exc2.description}); migrate or delete it"
                ) from exc2

    await _with_retries(f"create stream {spec.name}", add_or_update)
    for c in spec.consumers:
        await ensure_consumer(js, spec, c, admin=admin)


async def ensure_consumer(js: JetStreamContext, stream: StreamSpec, spec: ConsumerSpec, *, admin: bool = True) -> None:
    cc = consumer_config(spec)

    async def add() -> None:
        try:
            have = (await js.consumer_info(stream.name, spec.durable)).config
        except nats.js.errors.NotFoundError:
            have = None
        if have is not None and _same_consumer(have, cc):
            return
        if not admin:
            state = "is missing" if have is None else "differs from the subject table"
            raise _needs_admin(f"consumer {spec.durable} on {stream.name} {state}")
        try:
            await js.add_consumer(stream.name, cc)
        except nats.js.errors.BadRequestError as exc:
            raise BusError(f"cannot create consumer {spec.durable} on {stream.name}: {exc.description}") from exc

    await _with_retries(f"create consumer {spec.durable}", add)


async def ensure_all(js: JetStreamContext, topology: Topology, cfg: BusConfig, *, admin: bool = True) -> None:
    for spec in topology.streams.values():
        await ensure_stream(js, spec, topology.subjects[spec.name], cfg, admin=admin)
