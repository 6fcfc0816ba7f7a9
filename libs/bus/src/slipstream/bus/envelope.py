"""What goes on the wire for one publish: the encoded body and its headers, checked for size.

Every message carries `Slipstream-Schema: Name/version`, `Nats-Msg-Id` when the caller gives one
(the stream drops a repeat inside its duplicate window), and the W3C trace context of the caller.
A message the server would refuse is rejected here, before any byte is sent: a NATS server
answers an oversized HPUB by closing the connection.
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from slipstream.bus.base import PayloadTooLarge
from slipstream.bus.tracing import inject
from slipstream.schemas.codec import SCHEMA_HEADER, encode, schema_header

MSG_ID_HEADER = "Nats-Msg-Id"
# "NATS/1.0\r\n" + final "\r\n"; each header adds "k: v\r\n".
_HEADER_OVERHEAD = 12

_schema_headers: dict[type, str] = {}


def schema_of(cls: type) -> str:
    found = _schema_headers.get(cls)
    if found is None:
        if not (hasattr(cls, "SCHEMA") and hasattr(cls, "VERSION")):
            raise TypeError(f"{cls.__name__} is not a Slipstream wire type (it declares no SCHEMA/VERSION)")
        found = _schema_headers[cls] = schema_header(cls)
    return found


def _check_header_value(name: str, value: str) -> None:
    if not isinstance(value, str) or "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
        raise ValueError(f"invalid header {name!r}: {value!r} (names without ':', values one-line strings)")


def headers_for(
    msg: msgspec.Struct, msg_id: str | None, extra: Mapping[str, str] | None, *, trace: bool = True
) -> dict[str, str]:
    hdrs = {SCHEMA_HEADER: schema_of(type(msg))}
    if extra:
        for k, v in extra.items():
            _check_header_value(k, v)
            hdrs[k] = v
    if msg_id is not None:
        _check_header_value(MSG_ID_HEADER, msg_id)
        hdrs[MSG_ID_HEADER] = msg_id
    if trace:
        inject(hdrs)
    return hdrs


def wire_size(data: bytes, headers: Mapping[str, str] | None) -> int:
    """Bytes the server counts against max_payload: body plus the encoded header block."""
    if not headers:
        return len(data)
    size = len(data) + _HEADER_OVERHEAD
    for k, v in headers.items():
        size += len(k) + len(v) + 4
    return size


def check_size(subject: str, data: bytes, headers: Mapping[str, str] | None, limit: int) -> int:
    size = wire_size(data, headers)
    if size > limit:
        raise PayloadTooLarge(
            f"message for {subject!r} is {size} bytes (body {len(data)} + headers), over the server's "
            f"max_payload of {limit} bytes; put large payloads in the object store and publish a reference"
        )
    return size


def envelope(
    subject: str,
    msg: msgspec.Struct,
    msg_id: str | None,
    extra: Mapping[str, str] | None,
    limit: int,
) -> tuple[bytes, dict[str, str]]:
    """Encode and head one message; raises PayloadTooLarge before anything is sent."""
    data = encode(msg)
    hdrs = headers_for(msg, msg_id, extra)
    check_size(subject, data, hdrs, limit)
    return data, hdrs
