"""Bus configuration section (`[bus]`): which backend, where the server is, and the publish/fetch bounds."""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta


class BusConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Annotated[
        Literal["nats", "memory"], Doc(description="Bus backend: 'nats' (JetStream) or 'memory' (one process).")
    ] = "nats"
    url: Annotated[str, Doc(description="NATS server URL(s), comma-separated.")] = "nats://127.0.0.1:4222"
    connect_timeout_s: Annotated[float, Doc(description="Timeout of one connection attempt.")] = 2.0
    ack_timeout_s: Annotated[
        float, Doc(description="Longest wait for a JetStream publish ack before it is retried or fails.")
    ] = 10.0
    max_inflight_bytes: Annotated[int, Doc(description="Bound on bytes published but not yet acked.")] = (
        32 * 1024 * 1024
    )
    max_inflight_msgs: Annotated[int, Doc(description="Bound on messages published but not yet acked.")] = 4096
    fetch_batch: Annotated[int, Doc(description="Messages per pull-consumer fetch.")] = 64
    fetch_timeout_s: Annotated[float, Doc(description="Longest wait of one fetch when the stream is empty.")] = 1.0
    stream_storage: Annotated[
        Literal["file", "memory"], Doc(description="JetStream storage for streams created at start-up.")
    ] = "file"
    stream_replicas: Annotated[int, Doc(description="JetStream replicas for streams created at start-up.")] = 1
    publish_retries: Annotated[
        int, Doc(description="Re-sends of a publish whose ack was lost (same Nats-Msg-Id, so the stream dedups it).")
    ] = 2
    connect_budget_s: Annotated[
        float, Doc(description="How long the first connection is retried before BusUnavailable is raised.")
    ] = 15.0
    reconnect_wait_s: Annotated[float, Doc(description="Pause between reconnection attempts (forever).")] = 1.0
    drain_timeout_s: Annotated[float, Doc(description="Longest wait to drain subscriptions and acks on close.")] = 5.0
    memory_max_payload: Annotated[
        int, Doc(description="Largest message the memory backend accepts (NATS reads max_payload from the server).")
    ] = 1024 * 1024
