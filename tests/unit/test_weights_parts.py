"""Versions published per learner rank: the partition, part records, the merged manifest, and bad parts.

Versions of a small Llama trained by AdamW are published as two parts each (rank 0 and rank 1
store their halves, the merge commits one manifest): a fresh reader, a reader that follows every
version and one that catches up must hold exactly the published bits; a corrupted or missing
shard of one part is never applied.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch
from test_weights_chain import _same as _same_in_order
from test_weights_chain import _versions

from slipstream.schemas import WeightManifest
from slipstream.store import LocalObjectStore
from slipstream.trust import generate_keypair
from slipstream.trust.signing import payload
from slipstream.weights import CorruptShard, VersionExists, WeightsError, load_version, manifest_key, read_manifest
from slipstream.weights.chain import resolve_chain
from slipstream.weights.decoder import decode_version
from slipstream.weights.parts import (
    PartsError,
    abandon,
    commit_merged,
    fate,
    merge_parts,
    partition,
    publish_part,
    read_parts,
    split_parts,
)

pytestmark = pytest.mark.unit
RUN = "r"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Same names, dtypes and bits (a merged version lists its tensors part by part)."""
    return _same_in_order(dict(sorted(a.items())), dict(sorted(b.items())))


def _sizes(tensors: dict[str, torch.Tensor]) -> list[tuple[str, int]]:
    return [(n, t.numel() * t.element_size()) for n, t in tensors.items()]


def test_partition_is_deterministic_disjoint_complete_and_balanced() -> None:
    sizes = [("embed", 1000), ("a", 10), ("b", 300), ("c", 300), ("d", 250), ("norm", 4)]
    parts = partition(sizes, 2)
    assert parts == partition(list(sizes), 2)
    assert sorted(n for p in parts for n in p) == sorted(n for n, _ in sizes)
    assert all(parts) and len(parts) == 2
    # Each rank keeps state-dict order, and the biggest tensor does not leave its rank alone with nothing else.
    order = [n for n, _ in sizes]
    assert all(p == sorted(p, key=order.index) for p in parts)
    loads = [sum(dict(sizes)[n] for n in p) for p in parts]
    assert loads == [1000, 864]
    assert partition(sizes, 1) == [order]
    with pytest.raises(ValueError, match="every rank needs at least one"):
        partition(sizes[:2], 3)
    with pytest.raises(ValueError, match="listed twice"):
        partition([("a", 1), ("a", 2)], 1)


def _publish(
    store: LocalObjectStore, versions: list[dict[str, torch.Tensor]], keyframe_every: int, ranks: int = 2
) -> list[list[str]]:
    names = partition(_sizes(versions[0]), ranks)
    for v, tensors in enumerate(versions):
        for r in range(ranks):
            mine = {n: tensors[n] for n in names[r]}
            base = None if v == 0 else (v - 1, {n: versions[v - 1][n] for n in names[r]})
            publish_part(
                store,
                run_id=RUN,
                version=v,
                rank=r,
                tensors=mine,
                base=base,
                keyframe_every=keyframe_every,
                frame_bytes=16384,
                shard_bytes=32 * 1024,
                threads=2,
            )
        merged = merge_parts(read_parts(store, RUN, v, ranks), run_id=RUN, version=v, ranks=ranks)
        commit_merged(store, merged)
    return names


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "store")


def test_parts_decode_bit_exact_for_fresh_following_and_catching_up_readers(store: LocalObjectStore) -> None:
    versions = _versions(9, torch.bfloat16)
    _publish(store, versions, keyframe_every=4)
    manifests = [read_manifest(store, manifest_key(RUN, v)) for v in range(9)]
    assert [m.keyframe for m in manifests] == [v % 4 == 0 for v in range(9)]
    assert all(len(m.parts) == 2 and [p.rank for p in m.parts] == [0, 1] for m in manifests)
    assert all(m.base_version == (None if v % 4 == 0 else v - 1) for v, m in enumerate(manifests))
    assert all(len(m.shards) == sum(p.shards for p in m.parts) >= 2 for m in manifests)
    # Every tensor once, every shard key under its rank's prefix.
    for m in manifests:
        assert sorted(e.name for e in m.tensors) == sorted(versions[0])
        assert all(
            f"/rank-{p.rank}/" in s.key
            for p, sl in zip(m.parts, [s for _, s in split_parts(m)], strict=True)
            for s in m.shards[sl]
        )
    for v in range(9):
        assert _same(load_version(store, RUN, v, threads=2), versions[v])
    # A reader that follows every version, decoding each in place into what it holds.
    held = load_version(store, RUN, 0)
    for v in range(1, 9):
        held = load_version(store, RUN, v, have=(v - 1, held), inplace=True, threads=2)
        assert _same(held, versions[v])
    # One that missed versions 2..6 catches up from version 1 (deltas 2..7 on the chain) or a keyframe.
    assert [m.policy_version for m in resolve_chain(store, RUN, 7, 1)] == [4, 5, 6, 7]
    assert _same(load_version(store, RUN, 7, have=(1, versions[1])), versions[7])


def test_a_manifest_without_parts_signs_and_decodes_as_before(store: LocalObjectStore, tmp_path: Path) -> None:
    m = WeightManifest(policy_version=3, run_id=RUN)
    assert b"parts" not in payload(m)  # old signatures stay valid: an empty parts list is not signed
    versions = _versions(2, torch.float32)
    _publish(store, versions, keyframe_every=10)
    merged = read_manifest(store, manifest_key(RUN, 1))
    assert b'"parts"' in payload(merged)
    key = generate_keypair(tmp_path / "k.pem")
    from slipstream.trust import sign_manifest

    signed = sign_manifest(merged, key)
    tampered = msgspec.structs.replace(signed, parts=[msgspec.structs.replace(signed.parts[0], shards=9)])
    assert payload(tampered) != payload(signed)


def _one_version(store: LocalObjectStore, tensors: dict[str, torch.Tensor], names: list[list[str]], v: int, **kw):
    return [
        publish_part(store, run_id=RUN, version=v, rank=r, tensors={n: tensors[n] for n in names[r]}, **kw)[0]
        for r in range(len(names))
    ]


def test_parts_that_do_not_fit_are_not_merged(store: LocalObjectStore) -> None:
    versions = _versions(2, torch.float32)
    names = partition(_sizes(versions[0]), 2)
    p0, p1 = _one_version(store, versions[0], names, 0)
    with pytest.raises(PartsError, match=r"no part from rank\(s\) \[1\]"):
        merge_parts({0: p0}, run_id=RUN, version=0, ranks=2)
    with pytest.raises(PartsError, match="not 1"):
        merge_parts({0: p0, 1: p1}, run_id=RUN, version=1, ranks=2)
    with pytest.raises(PartsError, match="different fence tokens"):
        merge_parts({0: p0, 1: msgspec.structs.replace(p1, fence_token=7)}, run_id=RUN, version=0, ranks=2)
    with pytest.raises(PartsError, match="different base versions"):
        merge_parts(
            {
                0: msgspec.structs.replace(p0, keyframe=False, base_version=3),
                1: msgspec.structs.replace(p1, keyframe=False, base_version=4),
            },
            run_id=RUN,
            version=0,
            ranks=2,
        )
    with pytest.raises(PartsError, match="in two parts"):
        merge_parts({0: p0, 1: p0}, run_id=RUN, version=0, ranks=2)
    # A rank's part mixes with another's keyframe: the version is a delta on the common base.
    mixed = merge_parts(
        {0: msgspec.structs.replace(p0, keyframe=False, base_version=3), 1: p1}, run_id=RUN, version=0, ranks=2
    )
    assert (mixed.keyframe, mixed.base_version, [p.keyframe for p in mixed.parts]) == (False, 3, [False, True])


def test_a_version_is_committed_or_abandoned_never_both(store: LocalObjectStore) -> None:
    versions = _versions(1, torch.float32)
    names = partition(_sizes(versions[0]), 2)
    parts = _one_version(store, versions[0], names, 0)
    assert fate(store, RUN, 0) is None
    assert abandon(store, RUN, 0, "rank 1 never came", [1]) is True
    assert abandon(store, RUN, 0, "again") is False
    assert fate(store, RUN, 0) == "abandoned"
    with pytest.raises(VersionExists, match="abandoned"):
        commit_merged(store, merge_parts(dict(enumerate(parts)), run_id=RUN, version=0, ranks=2))
    assert not store.exists(manifest_key(RUN, 0))
    # And the other way round.
    _one_version(store, versions[0], names, 1)
    commit_merged(store, merge_parts(read_parts(store, RUN, 1, 2), run_id=RUN, version=1, ranks=2))
    assert fate(store, RUN, 1) == "committed"
    with pytest.raises(VersionExists, match="committed"):
        abandon(store, RUN, 1, "too late")
    # A part stored again (a retried or restarted publisher) is read back, not re-uploaded.
    again, existed = publish_part(store, run_id=RUN, version=1, rank=0, tensors={n: versions[0][n] for n in names[0]})
    assert existed and again == parts[0].__class__(**msgspec.structs.asdict(read_parts(store, RUN, 1, 2)[0]))


def test_a_corrupted_or_missing_shard_of_one_part_is_never_applied(store: LocalObjectStore) -> None:
    versions = _versions(3, torch.bfloat16)
    _publish(store, versions, keyframe_every=10)
    held = load_version(store, RUN, 1)
    snapshot = {k: v.clone() for k, v in held.items()}
    m = read_manifest(store, manifest_key(RUN, 2))
    rank1 = [s for s in m.shards if "/rank-1/" in s.key]
    data = bytearray(store.get(rank1[0].key))
    data[len(data) // 2] ^= 0x01
    store.put(rank1[0].key, bytes(data))
    with pytest.raises(CorruptShard, match="rank-1"):
        load_version(store, RUN, 2, have=(1, held), attempts=2, threads=2)
    assert _same(held, snapshot)  # nothing of version 2 landed, rank 0's part included
    store.delete(rank1[0].key)
    with pytest.raises(WeightsError, match="missing shard"):
        load_version(store, RUN, 2, have=(1, held), attempts=1)
    assert _same(held, snapshot)


def test_decode_refuses_parts_that_do_not_account_for_every_shard(store: LocalObjectStore) -> None:
    versions = _versions(1, torch.float32)
    _publish(store, versions, keyframe_every=10)
    m = read_manifest(store, manifest_key(RUN, 0))
    shards = [store.get(s.key) for s in m.shards]
    short = msgspec.structs.replace(
        m, parts=[msgspec.structs.replace(m.parts[0], shards=m.parts[0].shards - 1), m.parts[1]]
    )
    with pytest.raises(WeightsError, match="parts own"):
        decode_version(short, shards)
    assert _same(decode_version(m, shards), versions[0])
