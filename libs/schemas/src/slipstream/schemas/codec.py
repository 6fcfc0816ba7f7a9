"""Encoding and decoding of wire messages: msgpack via msgspec, never pickle.

Every message type declares `SCHEMA` (its name) and `VERSION`; the producer sends them in the
`Slipstream-Schema` header as `Name/version`. A consumer rejects (to the DLQ) a name it does not
expect or a version newer than it knows. Within a version, evolution is append-only: new fields
get defaults, existing fields never change type (proto/README.md).
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from slipstream.schemas.dead_letter import DeadLetter
from slipstream.schemas.evaluation import EvalResult
from slipstream.schemas.learner import LearnerStep
from slipstream.schemas.rollout import ScoredTrajectory, Task, Trajectory
from slipstream.schemas.weights import WeightAnnounce, WeightManifest, WeightsPromoted

SCHEMA_HEADER = "Slipstream-Schema"

MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.SCHEMA: cls  # type: ignore[attr-defined]
    for cls in (
        Task,
        Trajectory,
        ScoredTrajectory,
        WeightManifest,
        WeightAnnounce,
        WeightsPromoted,
        EvalResult,
        LearnerStep,
        DeadLetter,
    )
}

T = TypeVar("T", bound=msgspec.Struct)

_encoder = msgspec.msgpack.Encoder()
_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


class SchemaError(ValueError):
    """A message that cannot be accepted: wrong type, unknown version or undecodable bytes."""


def schema_header(cls: type[msgspec.Struct]) -> str:
    return f"{cls.SCHEMA}/{cls.VERSION}"  # type: ignore[attr-defined]


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes, cls: type[T]) -> T:
    dec = _decoders.get(cls)
    if dec is None:
        dec = _decoders[cls] = msgspec.msgpack.Decoder(cls)
    try:
        return dec.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"cannot decode {cls.__name__}: {exc}") from exc


def check_header(header: str | None, cls: type[msgspec.Struct]) -> None:
    """Raise SchemaError unless `header` names `cls` at a version this code understands.

    A missing header is accepted (producers outside Slipstream may not set it); the body must then
    still decode as `cls`.
    """
    if header is None:
        return
    name, _, ver = header.partition("/")
    want = cls.SCHEMA  # type: ignore[attr-defined]
    if name != want:
        raise SchemaError(f"unexpected schema {name!r}, this consumer reads {want!r}")
    try:
        version = int(ver)
    except ValueError:
        raise SchemaError(f"malformed schema header {header!r}") from None
    if version > cls.VERSION or version < 1:  # type: ignore[attr-defined]
        raise SchemaError(f"unknown schema version {header!r}; this consumer reads up to {schema_header(cls)}")


def decode_message(data: bytes, header: str | None, cls: type[T]) -> T:
    check_header(header, cls)
    return decode(data, cls)


def to_json(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def from_json(data: bytes, cls: type[T]) -> T:
    try:
        return msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"cannot decode {cls.__name__} from JSON: {exc}") from exc
