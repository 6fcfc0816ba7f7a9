"""Dead-lettering: a message no consumer can use goes to `dlq.<STREAM>` with its original bytes.

The body is never re-encoded. The headers are the original ones plus the reason and origin
(`slipstream.schemas.dead_letter` names them), so `DeadLetter.from_message` rebuilds the full
story and an operator can republish the original after a fix. The DLQ copy gets its own
`Nats-Msg-Id` (`dlq:<stream>:<seq>`): a message dead-lettered twice (the source `term` was
lost) is stored once, and two streams' messages that shared an id do not collide.

A message that fits the bus limit can still be too big for its dead letter (the DLQ headers add
a few hundred bytes). `fit` then drops the original headers, and if that is not enough cuts the
body to what fits, recording the original size and sha256 in headers: the message still leaves
its stream (it would otherwise be retried forever, invisible to backlog counts), the DLQ counts
it, and the cut is visible on the dead letter (`DeadLetter.cut`).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Literal

from slipstream.bus.envelope import MSG_ID_HEADER, wire_size
from slipstream.bus.instruments import DLQ_CUT, DLQ_MESSAGES
from slipstream.schemas.dead_letter import (
    H_CONSUMER,
    H_DELIVERIES,
    H_ORIGINAL_SHA256,
    H_ORIGINAL_SIZE,
    H_REASON,
    H_SEQUENCE,
    H_STREAM,
    H_SUBJECT,
)
from slipstream.schemas.subjects import dlq_subject

# The original Nats-Msg-Id, kept because the DLQ copy needs an id of its own.
H_ORIGINAL_MSG_ID = "Slipstream-Dlq-Msg-Id"
ReasonKind = Literal["decode", "schema", "max_deliveries"]
_MAX_REASON = 400
log = logging.getLogger(__name__)


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MAX_REASON else flat[: _MAX_REASON - 3] + "..."


def dead_letter_headers(
    original: dict[str, str] | None,
    *,
    kind: ReasonKind,
    detail: str,
    subject: str,
    stream: str,
    consumer: str,
    deliveries: int,
    sequence: int,
) -> dict[str, str]:
    hdrs: dict[str, str] = {}
    for k, v in (original or {}).items():
        # Nats-* headers steer the server (dedup, expected stream/sequence); they must not apply
        # to the copy. The id is kept under another name.
        if k == MSG_ID_HEADER:
            hdrs[H_ORIGINAL_MSG_ID] = v
        elif not k.startswith("Nats-"):
            hdrs[k] = v
    hdrs[H_REASON] = f"{kind}: {_one_line(detail)}"
    hdrs[H_SUBJECT] = subject
    hdrs[H_STREAM] = stream
    hdrs[H_CONSUMER] = consumer
    hdrs[H_DELIVERIES] = str(deliveries)
    hdrs[H_SEQUENCE] = str(sequence)
    hdrs[MSG_ID_HEADER] = f"dlq:{stream}:{sequence}"
    return hdrs


def fit(data: bytes, full: dict[str, str], slim: dict[str, str], limit: int) -> tuple[bytes, dict[str, str], int]:
    """The dead letter's (body, headers) within `limit` wire bytes, and how many body bytes were cut.

    `full` are `dead_letter_headers` with the original headers, `slim` without them. Tried in
    order: `full`; `slim`; `slim` plus the original body's size and sha256, with the body cut.
    """
    if wire_size(data, full) <= limit:
        return data, full, 0
    if wire_size(data, slim) <= limit:
        return data, slim, 0
    hdrs = dict(slim)
    hdrs[H_ORIGINAL_SIZE] = str(len(data))
    hdrs[H_ORIGINAL_SHA256] = hashlib.sha256(data).hexdigest()
    keep = max(0, limit - wire_size(b"", hdrs))
    return data[:keep], hdrs, len(data) - keep


def target(stream: str) -> str:
    return dlq_subject(stream)


def count(stream: str, kind: ReasonKind, subject: str, sequence: int, detail: str, cut: int = 0) -> None:
    DLQ_MESSAGES.add(1, stream=stream, reason=kind)
    if cut:
        DLQ_CUT.add(1, stream=stream)
    log.warning(
        "dead-lettered %s seq %d from %s (%s): %s%s",
        subject,
        sequence,
        stream,
        kind,
        _one_line(detail),
        f" (body cut by {cut} bytes to fit the bus limit)" if cut else "",
    )
