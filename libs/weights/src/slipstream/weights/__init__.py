"""Weight versions in the object store: keyframes and lossless deltas, manifest last, sha256-verified reads.

- errors.py: `WeightsError`, the base of every error here, and the shared failures.
- snapshot.py: full raw snapshots (`publish_snapshot`).
- chain.py: versions as zstd keyframes every K versions and XOR/sparse deltas between them
  (`publish_version`), and the way back for a worker (`resolve_chain`, `load_version`, and
  `fetch_version` for any committed version, raw snapshots included).
- upload.py: an encoded version's shards into the store (a whole version's or a rank's part).
- parts.py: versions published per learner rank and merged into one manifest.
- encoder.py / decoder.py: one version to shard bytes and back, bit-exact, on several cores.
"""

from slipstream.weights.chain import (
    DEFAULT_FETCH_ATTEMPTS,
    DEFAULT_KEYFRAME_EVERY,
    Published,
    apply_chain,
    fetch_verified,
    fetch_version,
    is_keyframe_version,
    latest_version,
    load_version,
    publish_version,
    resolve_chain,
    store_coded,
)
from slipstream.weights.container import ShardFormatError
from slipstream.weights.decoder import BaseMismatch, decode_version
from slipstream.weights.encoder import DEFAULT_FRAME_BYTES, DEFAULT_LEVEL, CodedVersion, encode_version
from slipstream.weights.errors import CorruptShard, VersionExists, WeightsError
from slipstream.weights.fingerprint import fingerprint
from slipstream.weights.layout import manifest_key, shard_key, version_prefix
from slipstream.weights.snapshot import (
    DEFAULT_SHARD_BYTES,
    cut_shards,
    decode_snapshot,
    fetch_shards,
    publish_snapshot,
    read_manifest,
)

__all__ = [
    "DEFAULT_FETCH_ATTEMPTS",
    "DEFAULT_FRAME_BYTES",
    "DEFAULT_KEYFRAME_EVERY",
    "DEFAULT_LEVEL",
    "DEFAULT_SHARD_BYTES",
    "BaseMismatch",
    "CodedVersion",
    "CorruptShard",
    "Published",
    "ShardFormatError",
    "VersionExists",
    "WeightsError",
    "apply_chain",
    "cut_shards",
    "decode_snapshot",
    "decode_version",
    "encode_version",
    "fetch_shards",
    "fetch_verified",
    "fetch_version",
    "fingerprint",
    "is_keyframe_version",
    "latest_version",
    "load_version",
    "manifest_key",
    "publish_snapshot",
    "publish_version",
    "read_manifest",
    "resolve_chain",
    "shard_key",
    "store_coded",
    "version_prefix",
]
