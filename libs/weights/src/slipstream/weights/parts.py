"""Versions published per learner rank: each rank's publisher stores its part, rank 0 commits the manifest.

With `ranks = N` the learner's tensors are split by `partition` (a deterministic function of the
tensor names and sizes, so every rank and every restart agrees on it). Rank r's weight-publisher
encodes only its part (a keyframe, or a delta against its part of the last committed version),
uploads the shards under `v<version>/rank-<r>/` and writes its part record there (`publish_part`;
write-once, so a retried or restarted publisher re-reads what it stored). The rank-0 publisher
waits for every part record, checks they fit together (`merge_parts`) and commits one manifest
naming every part's shards, signed as any manifest (`commit_merged`); or, when a part never
arrives or does not fit, writes an abandon record instead (`abandon`). Exactly one of the two is
ever written for a version (both write-once, only rank 0 writes either), so every publisher
learns the same fate (`fate`) and encodes the next version against the same committed base.

A worker reads a merged manifest like any other: `fetch_verified` fetches every shard of every
part in parallel and verifies each against its sha256 before anything is decoded, and the
decoder decodes part by part (`split_parts`), each against its own content fingerprint. A
version with a missing or corrupted part is never applied, and a version that was abandoned is
never announced.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import msgspec
import torch

from slipstream.schemas import AbandonedVersion, PartRef, ShardRef, TensorEntry, WeightManifest, from_json, to_json
from slipstream.store import ObjectNotFound, ObjectStore
from slipstream.weights import layout
from slipstream.weights.encoder import DEFAULT_FRAME_BYTES, DEFAULT_LEVEL, delta_mismatch, encode_version
from slipstream.weights.errors import VersionExists, WeightsError
from slipstream.weights.snapshot import DEFAULT_SHARD_BYTES, signature
from slipstream.weights.upload import upload_shards

Fate = Literal["committed", "abandoned"]


class PartsError(WeightsError):
    """Part records of one version that cannot be merged into a manifest; the message says how."""


def partition(sizes: Sequence[tuple[str, int]], ranks: int) -> list[list[str]]:
    """Tensor names per rank: biggest first onto the least-loaded rank (ties: the lower rank).

    `sizes` lists (name, bytes) in state-dict order; each rank's names keep that order. The
    result depends only on `sizes` and `ranks`. Raises ValueError when a rank would get nothing.
    """
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    names = [n for n, _ in sizes]
    if len(set(names)) != len(names):
        raise ValueError("partition: a tensor name is listed twice")
    if len(names) < ranks:
        raise ValueError(f"cannot split {len(names)} tensors across {ranks} ranks: every rank needs at least one")
    order = {n: i for i, n in enumerate(names)}
    loads = [0] * ranks
    owned: list[list[str]] = [[] for _ in range(ranks)]
    for name, nbytes in sorted(sizes, key=lambda s: (-s[1], order[s[0]])):
        # Empty ranks first, so that every rank holds a tensor even when a few dominate the bytes.
        r = min(range(ranks), key=lambda k: (bool(owned[k]), loads[k], k))
        owned[r].append(name)
        loads[r] += nbytes
    return [sorted(part, key=order.__getitem__) for part in owned]


def _read(store: ObjectStore, key: str) -> WeightManifest:
    return from_json(store.get(key), WeightManifest)


def publish_part(
    store: ObjectStore,
    *,
    run_id: str,
    version: int,
    rank: int,
    tensors: Mapping[str, torch.Tensor],
    base: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    keyframe_every: int = 10,
    step_finished_at: float = 0.0,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    frame_bytes: int = DEFAULT_FRAME_BYTES,
    level: int = DEFAULT_LEVEL,
    threads: int = 0,
    fence_token: int = 0,
) -> tuple[WeightManifest, bool]:
    """Store rank `rank`'s part of `version`; returns (its part record, whether it was stored before).

    A delta against `base` = (version, this rank's tensors of it) when the version is not due as a
    keyframe, the base fits (names, dtypes, shapes) and the base version is committed; otherwise a
    keyframe. A part record already in the store is returned as it is (nothing is uploaded).
    """
    key = layout.part_key(run_id, version, rank)
    if store.exists(key):
        return _read(store, key), True
    if keyframe_every < 1:
        raise ValueError(f"keyframe_every must be >= 1, got {keyframe_every}")
    delta_base = None if base is None or version % keyframe_every == 0 else base
    if delta_base is not None and (
        delta_mismatch(tensors, delta_base[1]) is not None
        or not store.exists(layout.manifest_key(run_id, delta_base[0]))
    ):
        delta_base = None
    coded = encode_version(
        tensors,
        None if delta_base is None else delta_base[1],
        level=level,
        threads=threads,
        frame_bytes=frame_bytes,
        shard_bytes=shard_bytes,
    )
    record = upload_shards(
        store,
        coded,
        lambda i: layout.part_shard_key(run_id, version, rank, i),
        run_id=run_id,
        version=version,
        base_version=None if delta_base is None else delta_base[0],
        step_finished_at=step_finished_at,
        fence_token=fence_token,
        threads=threads,
    )
    if not store.put_if_absent(key, to_json(record)):
        return _read(store, key), True  # a second writer of this rank got there first: its record stands
    return record, False


def read_parts(store: ObjectStore, run_id: str, version: int, ranks: int) -> dict[int, WeightManifest]:
    """The part records of `version` stored so far, by rank (a rank without one is absent)."""
    keys = {r: layout.part_key(run_id, version, r) for r in range(ranks)}
    out: dict[int, WeightManifest] = {}
    for r, key in keys.items():
        try:
            out[r] = _read(store, key)
        except ObjectNotFound:
            continue
    return out


def merge_parts(parts: Mapping[int, WeightManifest], *, run_id: str, version: int, ranks: int) -> WeightManifest:
    """One (unsigned) manifest naming every rank's shards, in rank order. Raises PartsError naming what does not fit:
    a missing rank, a part of another run or version, delta parts on different bases, different fence tokens, or a
    tensor in two parts."""
    missing = [r for r in range(ranks) if r not in parts]
    if missing:
        raise PartsError(f"version {version}: no part from rank(s) {missing}")
    ordered = [parts[r] for r in range(ranks)]
    for r, p in enumerate(ordered):
        if p.policy_version != version or p.run_id != run_id:
            raise PartsError(f"rank {r}'s part is version {p.policy_version} of run {p.run_id!r}, not {version}")
    bases = {p.base_version for p in ordered if not p.keyframe}
    if len(bases) > 1:
        raise PartsError(f"version {version}: delta parts on different base versions {sorted(map(str, bases))}")
    tokens = {p.fence_token for p in ordered}
    if len(tokens) > 1:
        raise PartsError(f"version {version}: parts staged under different fence tokens {sorted(tokens)}")
    shards: list[ShardRef] = []
    tensors: list[TensorEntry] = []
    refs: list[PartRef] = []
    seen: set[str] = set()
    for r, p in enumerate(ordered):
        for e in p.tensors:
            if e.name in seen:
                raise PartsError(f"version {version}: tensor {e.name!r} is in two parts (rank {r} and an earlier one)")
            seen.add(e.name)
            tensors.append(msgspec.structs.replace(e, shard=e.shard + len(shards)))
        refs.append(
            PartRef(
                rank=r,
                shards=len(p.shards),
                keyframe=p.keyframe,
                base_version=p.base_version,
                key=layout.part_key(run_id, version, r),
            )
        )
        shards.extend(p.shards)
    keyframe = all(p.keyframe for p in ordered)
    return WeightManifest(
        policy_version=version,
        base_version=None if keyframe else bases.pop(),
        keyframe=keyframe,
        run_id=run_id,
        dtype=ordered[0].dtype,
        shards=shards,
        tensors=tensors,
        raw_bytes=sum(p.raw_bytes for p in ordered),
        stored_bytes=sum(p.stored_bytes for p in ordered),
        step_finished_at=max(p.step_finished_at for p in ordered),
        created_at=time.time(),
        signature=signature(shards),
        fence_token=tokens.pop(),
        parts=refs,
    )


def commit_merged(
    store: ObjectStore, manifest: WeightManifest, *, seal: Callable[[WeightManifest], WeightManifest] | None = None
) -> tuple[str, WeightManifest]:
    """Write a merged manifest last and write-once (VersionExists if it is there, or an abandon record is)."""
    version, run_id = manifest.policy_version, manifest.run_id
    if store.exists(layout.abandoned_key(run_id, version)):
        raise VersionExists(f"weight version {version} of run {run_id} was abandoned; it is never committed")
    if seal is not None:
        manifest = seal(manifest)
    key = layout.manifest_key(run_id, version)
    if not store.put_if_absent(key, to_json(manifest)):
        raise VersionExists(f"weight version {version} of run {run_id} is already committed ({key})")
    return key, manifest


def abandon(store: ObjectStore, run_id: str, version: int, reason: str, missing_ranks: Sequence[int] = ()) -> bool:
    """Record that `version` will never be committed; False when an abandon record was already there.

    Raises VersionExists when the version is committed (its manifest stands)."""
    if store.exists(layout.manifest_key(run_id, version)):
        raise VersionExists(f"weight version {version} of run {run_id} is committed; it cannot be abandoned")
    record = AbandonedVersion(
        policy_version=version,
        run_id=run_id,
        reason=reason,
        missing_ranks=list(missing_ranks),
        abandoned_at=time.time(),
    )
    return store.put_if_absent(layout.abandoned_key(run_id, version), to_json(record))


def fate(store: ObjectStore, run_id: str, version: int) -> Fate | None:
    """Whether `version` is committed, abandoned, or (None) not decided yet."""
    if store.exists(layout.manifest_key(run_id, version)):
        return "committed"
    if store.exists(layout.abandoned_key(run_id, version)):
        return "abandoned"
    return None


def decided_after(store: ObjectStore, run_id: str, version: int) -> int | None:
    """The newest version above `version` that is committed or abandoned, or None (lists the run's versions).

    Rank 0's publisher settles versions in order, so one settled above `version` while `version`
    is not means rank 0 never had `version` staged: it will never be settled."""
    prefix = layout.version_prefix(run_id, 0).rsplit("/", 1)[0] + "/"
    names = (
        "/" + layout.manifest_key(run_id, 0).rsplit("/", 1)[1],
        "/" + layout.abandoned_key(run_id, 0).rsplit("/", 1)[1],
    )
    found = [layout.version_of_manifest_key(k) for k in store.list(prefix) if k.endswith(names)]
    later = [v for v in found if v > version]
    return max(later, default=None)


def split_parts(manifest: WeightManifest) -> list[tuple[WeightManifest, slice]]:
    """A merged manifest as one sub-manifest per part (shard indices local to the part) and its slice of the shards.

    Raises WeightsError when the parts do not account for every shard and tensor exactly once."""
    v = manifest.policy_version
    total = sum(p.shards for p in manifest.parts)
    if total != len(manifest.shards) or any(p.shards < 1 for p in manifest.parts):
        raise WeightsError(
            f"version {v}: parts own {total} shards (each at least one), the manifest lists {len(manifest.shards)}"
        )
    out: list[tuple[WeightManifest, slice]] = []
    start = 0
    placed = 0
    for p in manifest.parts:
        sl = slice(start, start + p.shards)
        entries = [
            msgspec.structs.replace(e, shard=e.shard - start) for e in manifest.tensors if sl.start <= e.shard < sl.stop
        ]
        if p.keyframe == (p.base_version is not None) or (not p.keyframe and p.base_version != manifest.base_version):
            raise WeightsError(f"version {v}: rank {p.rank}'s part has an inconsistent base ({p.base_version})")
        sub = msgspec.structs.replace(
            manifest,
            shards=manifest.shards[sl],
            tensors=entries,
            keyframe=p.keyframe,
            base_version=p.base_version,
            parts=[],
        )
        out.append((sub, sl))
        placed += len(entries)
        start = sl.stop
    if placed != len(manifest.tensors):
        raise WeightsError(f"version {v}: {len(manifest.tensors) - placed} tensor(s) lie in no part's shards")
    return out
