"""Full snapshots: a state dict cut into size-bounded shards, each with a sha256.

`publish_snapshot` uploads the shards in parallel and writes the manifest last (write-once), so a
reader that finds a manifest finds every shard. `fetch_shards` verifies every shard's digest
before anything is decoded: a corrupted or missing shard raises and nothing is applied
(`chain.fetch_version` reads any committed version, a raw snapshot through this module).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from slipstream.schemas import ShardRef, TensorEntry, WeightManifest, from_json, to_json
from slipstream.store import ObjectNotFound, ObjectStore
from slipstream.weights import layout
from slipstream.weights.errors import CorruptShard, VersionExists, WeightsError
from slipstream.weights.tensors import as_bytes_view, dtype_name, from_bytes

DEFAULT_SHARD_BYTES = 64 * 1024 * 1024


@dataclass
class EncodedVersion:
    shards: list[bytes]
    tensors: list[TensorEntry]
    raw_bytes: int


def cut_shards(tensors: Mapping[str, torch.Tensor], shard_bytes: int = DEFAULT_SHARD_BYTES) -> EncodedVersion:
    """Concatenate raw tensor bytes into shards of at most `shard_bytes` (a tensor never splits)."""
    shards: list[bytes] = []
    entries: list[TensorEntry] = []
    current: list[memoryview] = []
    size = 0
    raw = 0
    for name, t in tensors.items():
        view = as_bytes_view(t)
        if current and size + view.nbytes > shard_bytes:
            shards.append(b"".join(current))
            current, size = [], 0
        entries.append(
            TensorEntry(
                name=name,
                dtype=dtype_name(t.dtype),
                shape=list(t.shape),
                shard=len(shards),
                offset=size,
                nbytes=view.nbytes,
            )
        )
        current.append(view)
        size += view.nbytes
        raw += view.nbytes
    if current:
        shards.append(b"".join(current))
    return EncodedVersion(shards=shards, tensors=entries, raw_bytes=raw)


def signature(shards: list[ShardRef]) -> str:
    h = hashlib.sha256()
    for s in shards:
        h.update(s.sha256.encode())
    return h.hexdigest()


def publish_snapshot(
    store: ObjectStore,
    *,
    run_id: str,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    step_finished_at: float = 0.0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    fence_token: int = 0,
    seal: Callable[[WeightManifest], WeightManifest] | None = None,
) -> tuple[str, WeightManifest]:
    """Store a full snapshot of `tensors` as `version`; returns (manifest key, manifest).

    Raises VersionExists if a manifest for this version is already committed (versions are
    write-once: a second writer never overwrites what workers may have applied). `fence_token`
    is recorded in the manifest; `seal` (a signer) sees the manifest last.
    """
    mkey = layout.manifest_key(run_id, version)
    if store.exists(mkey):
        raise VersionExists(f"weight version {version} of run {run_id} is already published ({mkey})")
    enc = cut_shards(tensors, shard_bytes)
    refs: list[ShardRef] = []
    items: dict[str, bytes] = {}
    for i, data in enumerate(enc.shards):
        key = layout.shard_key(run_id, version, i)
        items[key] = data
        refs.append(ShardRef(key=key, size=len(data), sha256=hashlib.sha256(data).hexdigest(), codec="raw"))
    store.put_many(items)
    manifest = WeightManifest(
        policy_version=version,
        base_version=None,
        keyframe=True,
        run_id=run_id,
        dtype=enc.tensors[0].dtype if enc.tensors else "",
        shards=refs,
        tensors=enc.tensors,
        raw_bytes=enc.raw_bytes,
        stored_bytes=sum(r.size for r in refs),
        step_finished_at=step_finished_at,
        created_at=time.time(),
        signature=signature(refs),
        fence_token=fence_token,
    )
    if seal is not None:
        manifest = seal(manifest)
    if not store.put_if_absent(mkey, to_json(manifest)):
        raise VersionExists(f"weight version {version} of run {run_id} was committed concurrently ({mkey})")
    return mkey, manifest


def read_manifest(store: ObjectStore, key: str) -> WeightManifest:
    try:
        return from_json(store.get(key), WeightManifest)
    except ObjectNotFound:
        raise WeightsError(f"manifest {key} not found in the object store") from None


def fetch_shards(store: ObjectStore, manifest: WeightManifest) -> list[bytes]:
    """Download every shard in parallel and verify its size and sha256."""
    try:
        got = store.get_many([s.key for s in manifest.shards])
    except ObjectNotFound as exc:
        raise WeightsError(f"version {manifest.policy_version}: missing shard ({exc})") from None
    out: list[bytes] = []
    for ref in manifest.shards:
        data = got[ref.key]
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != ref.size or digest != ref.sha256:
            raise CorruptShard(ref.key, ref.sha256, digest)
        out.append(data)
    return out


def decode_snapshot(manifest: WeightManifest, shards: list[bytes]) -> dict[str, torch.Tensor]:
    """Tensors of a raw (uncompressed) snapshot written by `publish_snapshot`."""
    if not manifest.keyframe:
        raise WeightsError(f"version {manifest.policy_version} is a delta; decode it onto its base")
    codecs = {s.codec for s in manifest.shards}
    if codecs - {"raw"}:
        raise WeightsError(
            f"version {manifest.policy_version} has {sorted(codecs)} shards; use slipstream.weights.chain"
        )
    out: dict[str, torch.Tensor] = {}
    for e in manifest.tensors:
        buf = memoryview(shards[e.shard])[e.offset : e.offset + e.nbytes]
        out[e.name] = from_bytes(buf, e.dtype, e.shape)
    return out
