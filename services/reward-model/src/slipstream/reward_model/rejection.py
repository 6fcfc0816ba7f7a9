"""Rejection: a delivery that can never be processed goes to `dlq.<STREAM>` with its reason, then is termed.

The bus dead-letters on its own what does not decode, has an unknown schema or ran out of
deliveries; this covers what only the service can judge (a trajectory for an environment it does
not know). The copy is the original bytes with the original headers (minus the `Nats-*` ones that
steer the server) plus the reason and origin headers of `slipstream.schemas.dead_letter`, exactly
as the bus writes its own, so `bus.dead_letters(stream)` and the tools read both alike. Its
`Nats-Msg-Id` is `dlq:<stream>:<sequence>`, so a rejection repeated after a lost `term` is stored
once.
"""

from __future__ import annotations

from typing import Any

from slipstream.bus import Bus, Delivery
from slipstream.bus.dlq import fit
from slipstream.schemas.dead_letter import H_CONSUMER, H_DELIVERIES, H_REASON, H_SEQUENCE, H_STREAM, H_SUBJECT
from slipstream.schemas.subjects import dlq_subject

MSG_ID_HEADER = "Nats-Msg-Id"
# Where the original message id goes (the copy needs an id of its own); the bus's DLQ uses the same name.
H_ORIGINAL_MSG_ID = "Slipstream-Dlq-Msg-Id"
_MAX_REASON = 400


def rejection_headers(
    delivery: Delivery[Any], *, reason: str, stream: str, consumer: str, keep_original: bool = True
) -> dict[str, str]:
    """Headers of the dead-letter copy of `delivery` (without its own headers when not `keep_original`)."""
    hdrs: dict[str, str] = {}
    for k, v in (delivery.headers if keep_original else {}).items():
        if k == MSG_ID_HEADER:
            hdrs[H_ORIGINAL_MSG_ID] = v
        elif not k.startswith("Nats-"):
            hdrs[k] = v
    flat = " ".join(reason.split())
    hdrs[H_REASON] = flat if len(flat) <= _MAX_REASON else flat[: _MAX_REASON - 3] + "..."
    hdrs[H_SUBJECT] = delivery.subject
    hdrs[H_STREAM] = stream
    hdrs[H_CONSUMER] = consumer
    hdrs[H_DELIVERIES] = str(delivery.num_delivered)
    hdrs[H_SEQUENCE] = str(delivery.stream_seq)
    hdrs[MSG_ID_HEADER] = f"dlq:{stream}:{delivery.stream_seq}"
    return hdrs


async def reject(bus: Bus, delivery: Delivery[Any], *, reason: str, stream: str, consumer: str) -> None:
    """Store the dead letter (waiting for the stream's ack), then term the source message.

    A failed DLQ publish raises (`PublishError`) before the term, so the message stays and is
    redelivered: it is never dropped without a trace. A message too big to fit beside the
    dead-letter headers loses its own headers, then the end of its body (`slipstream.bus.dlq.fit`
    records the cut), rather than being retried forever.
    """
    full = rejection_headers(delivery, reason=reason, stream=stream, consumer=consumer)
    slim = rejection_headers(delivery, reason=reason, stream=stream, consumer=consumer, keep_original=False)
    body, hdrs, _ = fit(delivery.data, full, slim, bus.max_payload)
    await bus.publish_raw(dlq_subject(stream), body, hdrs)
    await delivery.term()
