"""The codec seam: how one version's tensors become stored shards and a manifest, in one call.

This issue stores full snapshots (`slipstream.weights.publish_snapshot`: shards in parallel, each
with its sha256, the manifest written last and write-once). The next issue's delta codec (xor of
the bf16 bit patterns against the last published version, zstd, a keyframe every K versions)
replaces the body of `store_version` and nothing else: the publisher only ever sees a
`StoredVersion`.

Versions are write-once. A version whose manifest is already committed (a publisher that stored
it and died before announcing, or a second writer) is not written again: its committed manifest is
returned with `already_stored=True`, for the publisher to announce again.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from slipstream.schemas import WeightManifest
from slipstream.store import ObjectStore
from slipstream.weights import VersionExists, manifest_key, publish_snapshot, read_manifest

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class StoredVersion:
    version: int
    manifest_key: str
    manifest: WeightManifest
    already_stored: bool  # True: committed before this call; nothing was uploaded


def store_version(
    store: ObjectStore,
    *,
    run_id: str,
    version: int,
    load: Callable[[], Mapping[str, torch.Tensor]],
    step_finished_at: float,
    shard_bytes: int,
) -> StoredVersion:
    """Store `version` (tensors from `load()`, called only when the version is not stored yet). Blocking."""
    key = manifest_key(run_id, version)
    if not store.exists(key):
        try:
            key, manifest = publish_snapshot(
                store,
                run_id=run_id,
                version=version,
                tensors=load(),
                step_finished_at=step_finished_at,
                shard_bytes=shard_bytes,
            )
            return StoredVersion(version, key, manifest, already_stored=False)
        except VersionExists:
            pass  # committed by another writer between our check and our commit: theirs stands
    return StoredVersion(version, key, read_manifest(store, key), already_stored=True)
