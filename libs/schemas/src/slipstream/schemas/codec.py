"""Encoding and decoding of wire messages: msgpack via msgspec, never pickle.

Every message type declares `SCHEMA` (its name) and `VERSION`; the producer sends them in the
`Slipstream-Schema` header as `Name/version`. A consumer rejects (to the DLQ) a name it does not
expect or a version newer than it knows. Within a version, evolution is append-only: new fields
get defaults, existing fields never change type (proto/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import msgspec

from slipstream.schemas.dead_letter import DeadLetter
from slipstream.schemas.episode import Episode, ScoredEpisode, episode_from_trajectory, scored_episode_from_v1
from slipstream.schemas.evaluation import EvalResult
from slipstream.schemas.learner import LearnerStep
from slipstream.schemas.rollout import ScoredTrajectory, Task, Trajectory
from slipstream.schemas.subagents import SubagentReply, SubagentRequest
from slipstream.schemas.tools import ToolReply, ToolRequest
from slipstream.schemas.weights import WeightAnnounce, WeightManifest, WeightsPromoted

SCHEMA_HEADER = "Slipstream-Schema"

MESSAGE_TYPES: dict[str, type[msgspec.Struct]] = {
    cls.SCHEMA: cls  # type: ignore[attr-defined]
    for cls in (
        Task,
        Trajectory,
        ScoredTrajectory,
        Episode,
        ScoredEpisode,
        WeightManifest,
        WeightAnnounce,
        WeightsPromoted,
        EvalResult,
        LearnerStep,
        DeadLetter,
        ToolRequest,
        ToolReply,
        SubagentRequest,
        SubagentReply,
    )
}

T = TypeVar("T", bound=msgspec.Struct)

# A consumer of the key type also admits the older types listed under it, converted on decode, so
# producers still speaking the older type keep working: {reader: {older schema name: (type, upgrade)}}.
UPGRADES: dict[type[msgspec.Struct], dict[str, tuple[type[msgspec.Struct], Callable[[Any], Any]]]] = {
    Episode: {"Trajectory": (Trajectory, episode_from_trajectory)},
    ScoredEpisode: {"ScoredTrajectory": (ScoredTrajectory, scored_episode_from_v1)},
}

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


def upgrade_for(header: str | None, cls: type[T]) -> tuple[type[msgspec.Struct], Callable[[Any], T]] | None:
    """The (older type, upgrade) a consumer of `cls` uses for a message headed `header`, if any.

    None when the header names `cls` itself (or is missing) or names a type with no upgrade to
    `cls`; a header naming an upgradable type at a version newer than this code reads raises.
    """
    if header is None:
        return None
    name, _, _ = header.partition("/")
    found = UPGRADES.get(cls, {}).get(name)
    if found is None:
        return None
    check_header(header, found[0])
    return found  # type: ignore[return-value]


def decode_message(data: bytes, header: str | None, cls: type[T]) -> T:
    """Decode a message for a consumer of `cls`: `cls` itself, or an older type upgraded to it."""
    up = upgrade_for(header, cls)
    if up is not None:
        old_cls, upgrade = up
        return upgrade(decode(data, old_cls))
    check_header(header, cls)
    try:
        return decode(data, cls)
    except SchemaError:
        if header is not None:
            raise
        # No header (a producer outside Slipstream): try the older types this consumer admits.
        for old_cls, upgrade in UPGRADES.get(cls, {}).values():
            try:
                return upgrade(decode(data, old_cls))
            except SchemaError:
                continue
        raise


def to_json(msg: msgspec.Struct) -> bytes:
    return msgspec.json.encode(msg)


def from_json(data: bytes, cls: type[T]) -> T:
    try:
        return msgspec.json.decode(data, type=cls)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise SchemaError(f"cannot decode {cls.__name__} from JSON: {exc}") from exc
