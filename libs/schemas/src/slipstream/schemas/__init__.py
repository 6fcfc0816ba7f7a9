"""Slipstream's wire contract: message types, the subject table and the codec (msgspec only)."""

from slipstream.schemas.codec import (
    MESSAGE_TYPES,
    SCHEMA_HEADER,
    UPGRADES,
    SchemaError,
    check_header,
    decode,
    decode_message,
    encode,
    from_json,
    schema_header,
    to_json,
    upgrade_for,
)
from slipstream.schemas.dead_letter import DeadLetter
from slipstream.schemas.episode import (
    Episode,
    EpisodeRef,
    Sample,
    ScoredEpisode,
    ToolEvent,
    episode_from_trajectory,
    sample_from_trajectory,
    scored_episode_from_v1,
    stub_of,
)
from slipstream.schemas.evaluation import EvalResult
from slipstream.schemas.learner import LearnerStep
from slipstream.schemas.packing import pack_floats, pack_ids, pack_mask, unpack_floats, unpack_ids, unpack_mask
from slipstream.schemas.rollout import PolicySegment, ScoredTrajectory, Task, Timings, Trajectory, Turn
from slipstream.schemas.tools import ToolReply, ToolRequest
from slipstream.schemas.weights import ShardRef, TensorEntry, WeightAnnounce, WeightManifest, WeightsPromoted

__all__ = [
    "MESSAGE_TYPES",
    "SCHEMA_HEADER",
    "UPGRADES",
    "DeadLetter",
    "Episode",
    "EpisodeRef",
    "EvalResult",
    "LearnerStep",
    "PolicySegment",
    "Sample",
    "SchemaError",
    "ScoredEpisode",
    "ScoredTrajectory",
    "ShardRef",
    "Task",
    "TensorEntry",
    "Timings",
    "ToolEvent",
    "ToolReply",
    "ToolRequest",
    "Trajectory",
    "Turn",
    "WeightAnnounce",
    "WeightManifest",
    "WeightsPromoted",
    "check_header",
    "decode",
    "decode_message",
    "encode",
    "episode_from_trajectory",
    "from_json",
    "pack_floats",
    "pack_ids",
    "pack_mask",
    "sample_from_trajectory",
    "schema_header",
    "scored_episode_from_v1",
    "stub_of",
    "to_json",
    "unpack_floats",
    "unpack_ids",
    "unpack_mask",
    "upgrade_for",
]
