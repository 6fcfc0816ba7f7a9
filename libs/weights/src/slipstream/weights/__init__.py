"""Weight versions in the object store: sharded snapshots, manifest last, sha256-verified reads."""

from slipstream.weights.layout import manifest_key, shard_key, version_prefix
from slipstream.weights.snapshot import (
    CorruptShard,
    VersionExists,
    WeightsError,
    cut_shards,
    decode_snapshot,
    fetch_shards,
    fetch_version,
    publish_snapshot,
    read_manifest,
)

__all__ = [
    "CorruptShard",
    "VersionExists",
    "WeightsError",
    "cut_shards",
    "decode_snapshot",
    "fetch_shards",
    "fetch_version",
    "manifest_key",
    "publish_snapshot",
    "read_manifest",
    "shard_key",
    "version_prefix",
]
