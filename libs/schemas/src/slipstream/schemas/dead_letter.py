"""Dead letters: messages a consumer could not process, kept with their reason.

On the wire a dead letter is the original bytes as the body of a message on `dlq.<stream>`
with the reason and origin in headers (so nothing is re-encoded and nothing is lost); this struct
is the typed view tools build from such a message.
"""

from __future__ import annotations

from typing import ClassVar

import msgspec

# Header names carried by every message on dlq.<stream>.
H_REASON = "Slipstream-Dlq-Reason"
H_SUBJECT = "Slipstream-Dlq-Subject"
H_STREAM = "Slipstream-Dlq-Stream"
H_CONSUMER = "Slipstream-Dlq-Consumer"
H_DELIVERIES = "Slipstream-Dlq-Deliveries"
H_SEQUENCE = "Slipstream-Dlq-Sequence"
# Set only when the original did not fit in a dead letter (it was just under the bus limit and the
# DLQ headers pushed it over): the body was cut to fit, and these say what the whole one was.
H_ORIGINAL_SIZE = "Slipstream-Dlq-Original-Size"
H_ORIGINAL_SHA256 = "Slipstream-Dlq-Original-Sha256"


class DeadLetter(msgspec.Struct, kw_only=True):
    SCHEMA: ClassVar[str] = "DeadLetter"
    VERSION: ClassVar[int] = 1

    stream: str
    subject: str
    reason: str
    consumer: str = ""
    deliveries: int = 0
    sequence: int = 0
    data: bytes = b""
    headers: dict[str, str] = {}
    original_size: int = 0
    """Bytes of the original body when `data` is only its beginning (cut to fit the bus limit); 0 = whole."""
    original_sha256: str = ""
    """sha256 (hex) of the whole original body when it was cut; empty otherwise."""

    @property
    def cut(self) -> bool:
        """True when `data` is not the whole original body."""
        return self.original_size > len(self.data)

    @classmethod
    def from_message(cls, data: bytes, headers: dict[str, str]) -> DeadLetter:
        return cls(
            stream=headers.get(H_STREAM, ""),
            subject=headers.get(H_SUBJECT, ""),
            reason=headers.get(H_REASON, ""),
            consumer=headers.get(H_CONSUMER, ""),
            deliveries=int(headers.get(H_DELIVERIES, "0") or 0),
            sequence=int(headers.get(H_SEQUENCE, "0") or 0),
            data=data,
            headers=dict(headers),
            original_size=int(headers.get(H_ORIGINAL_SIZE, "0") or 0),
            original_sha256=headers.get(H_ORIGINAL_SHA256, ""),
        )
