"""An encoded version's shards into the store: hashed in parallel, named, and described by a manifest.

Both ways of publishing store shards this way: a whole version (`chain.store_coded`, which then
commits the manifest) and one learner rank's part (`parts.publish_part`, which records it).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from slipstream.schemas import ShardRef, WeightManifest
from slipstream.store import ObjectStore
from slipstream.weights import workers
from slipstream.weights.container import CODEC
from slipstream.weights.encoder import CodedVersion
from slipstream.weights.snapshot import signature


def shard_digests(shards: list[bytes], threads: int = 0) -> list[str]:
    """The sha256 hex digest of each shard, in order."""
    # hashlib releases the GIL on large buffers, so shards hash in parallel.
    return workers.run_each(lambda i: hashlib.sha256(shards[i]).hexdigest(), len(shards), threads)


def upload_shards(
    store: ObjectStore,
    coded: CodedVersion,
    shard_key: Callable[[int], str],
    *,
    run_id: str,
    version: int,
    base_version: int | None,
    step_finished_at: float = 0.0,
    fence_token: int = 0,
    threads: int = 0,
) -> WeightManifest:
    """Store an encoded version's shards (hashed in parallel) under `shard_key(i)` and return the
    manifest that names them (not stored: a whole version commits it, a rank's part records it)."""
    refs = [
        ShardRef(key=shard_key(i), size=len(data), sha256=digest, codec=CODEC)
        for i, (data, digest) in enumerate(zip(coded.shards, shard_digests(coded.shards, threads), strict=True))
    ]
    store.put_many({r.key: data for r, data in zip(refs, coded.shards, strict=True)})
    return WeightManifest(
        policy_version=version,
        base_version=base_version,
        keyframe=coded.keyframe,
        run_id=run_id,
        dtype=coded.tensors[0].dtype,
        shards=refs,
        tensors=coded.tensors,
        raw_bytes=coded.raw_bytes,
        stored_bytes=coded.stored_bytes,
        step_finished_at=step_finished_at,
        created_at=time.time(),
        signature=signature(refs),
        fence_token=fence_token,
    )
