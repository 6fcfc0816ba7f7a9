"""The bus's metrics, registered once in the process-wide registry.

Hot-path counters carry no labels (or one), and are bumped once per batch where a batch exists,
so counting costs well under a microsecond per message.
"""

from __future__ import annotations

from slipstream.telemetry.metrics import counter, gauge

PUBLISH_MESSAGES = counter("bus/publish/messages", "Messages acknowledged by a stream.")
PUBLISH_BYTES = counter("bus/publish/bytes", "Body bytes of messages acknowledged by a stream.")
PUBLISH_ERRORS = counter("bus/publish/errors", "Publishes that failed (label reason).")
PUBLISH_RETRIES = counter("bus/publish/retries", "Re-sends after an ack was lost or throttled.")
PUBLISH_DUPLICATES = counter("bus/publish/duplicates", "Publishes the stream dropped as duplicates of a msg id.")
CONSUME_MESSAGES = counter("bus/consume/messages", "Messages handed to consumers (label durable).")
CONSUME_PENDING = gauge(
    "bus/consume/pending",
    "Messages not yet delivered to a durable, as of its last delivery here (label durable; NATS backend).",
)
CONSUME_ERRORS = counter("bus/consume/errors", "Handler failures and fetch errors (label reason).")
DLQ_MESSAGES = counter("bus/dlq/messages", "Messages dead-lettered (labels stream, reason).")
DLQ_CUT = counter(
    "bus/dlq/cut", "Dead letters whose body was cut to fit the bus limit (label stream); the cut is in their headers."
)
DLQ_ERRORS = counter("bus/dlq/errors", "Dead letters that could not be published (left for redelivery).")
RECONNECTS = counter("bus/connection/reconnects", "Reconnections to the NATS server.")
DISCONNECTS = counter("bus/connection/disconnects", "Losses of the NATS connection.")
DENIED = counter(
    "bus/permission/denied", "Operations the server refused as outside this user's permissions (label op)."
)
