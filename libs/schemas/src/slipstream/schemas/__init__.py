"""Slipstream's wire contract: message types, the subject table and the codec (msgspec only)."""

from slipstream.schemas.codec import (
    MESSAGE_TYPES,
    SCHEMA_HEADER,
    SchemaError,
    check_header,
    decode,
    decode_message,
    encode,
    from_json,
    schema_header,
    to_json,
)
from slipstream.schemas.dead_letter import DeadLetter
from slipstream.schemas.evaluation import EvalResult
from slipstream.schemas.learner import LearnerStep
from slipstream.schemas.packing import pack_floats, pack_ids, pack_mask, unpack_floats, unpack_ids, unpack_mask
from slipstream.schemas.rollout import PolicySegment, ScoredTrajectory, Task, Timings, Trajectory, Turn
from slipstream.schemas.weights import ShardRef, TensorEntry, WeightAnnounce, WeightManifest, WeightsPromoted

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA_HEADER",
    "DeadLetter",
    "EvalResult",
    "LearnerStep",
    "PolicySegment",
    "SchemaError",
    "ScoredTrajectory",
    "ShardRef",
    "Task",
    "TensorEntry",
    "Timings",
    "Trajectory",
    "Turn",
    "WeightAnnounce",
    "WeightManifest",
    "WeightsPromoted",
    "check_header",
    "decode",
    "decode_message",
    "encode",
    "from_json",
    "pack_floats",
    "pack_ids",
    "pack_mask",
    "schema_header",
    "to_json",
    "unpack_floats",
    "unpack_ids",
    "unpack_mask",
]
