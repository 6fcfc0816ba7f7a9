"""A rollout worker's follower on versions published per rank: a bad part is never applied, later versions are.

Versions are stored as two parts each (slipstream.weights.parts), keyframes at 0 and 4. One shard
of rank 1's part of version 2 is corrupted and one of rank 0's part of version 5 is deleted: the
follower refuses 2 (and 3, a delta on it), counting each, and keeps sampling with version 1,
untouched; the keyframe 4 brings it back bit-exact; 5 is refused again and 4 stays applied.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from test_follower_memory import Engine, _versions

from slipstream.rollout_worker.follower import WeightFollower
from slipstream.rollout_worker.instruments import FETCH_FAILURES
from slipstream.schemas import WeightAnnounce
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key, read_manifest
from slipstream.weights.parts import commit_merged, merge_parts, partition, publish_part, read_parts

pytestmark = pytest.mark.unit
RUN = "r"


def _publish(store: LocalObjectStore, versions: list[dict[str, torch.Tensor]]) -> None:
    names = partition([(n, t.numel() * t.element_size()) for n, t in versions[0].items()], 2)
    for v, tensors in enumerate(versions):
        for r, mine in enumerate(names):
            base = None if v == 0 else (v - 1, {n: versions[v - 1][n] for n in mine})
            publish_part(
                store,
                run_id=RUN,
                version=v,
                rank=r,
                tensors={n: tensors[n] for n in mine},
                base=base,
                keyframe_every=4,
                threads=1,
            )
        commit_merged(store, merge_parts(read_parts(store, RUN, v, 2), run_id=RUN, version=v, ranks=2))


def _shard_of(store: LocalObjectStore, version: int, rank: int) -> str:
    return next(s.key for s in read_manifest(store, manifest_key(RUN, version)).shards if f"/rank-{rank}/" in s.key)


async def test_a_version_with_a_bad_part_is_refused_and_a_later_keyframe_applies(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    versions = _versions(6)
    _publish(store, versions)
    bad = bytearray(store.get(_shard_of(store, 2, 1)))
    bad[-1] ^= 0x40
    store.put(_shard_of(store, 2, 1), bytes(bad))
    store.delete(_shard_of(store, 5, 0))

    engine = Engine()
    follower = WeightFollower(cast(Any, None), store, cast(Any, engine), run_id=RUN, retries=0, backoff_s=0.0)
    follower.apply_timeout_s = 0.5

    def announce(v: int) -> WeightAnnounce:
        return WeightAnnounce(policy_version=v, manifest_key=manifest_key(RUN, v), run_id=RUN)

    assert await follower.apply(announce(1))
    assert follower._held is not None
    held = {k: t.clone() for k, t in follower._held[1].items()}
    before = FETCH_FAILURES.value(reason="fetch")
    assert not await follower.apply(announce(2))
    assert not await follower.apply(announce(3))
    assert FETCH_FAILURES.value(reason="fetch") == before + 2
    assert engine.policy_version == 1 and follower._held is not None and follower._held[0] == 1
    assert all(torch.equal(follower._held[1][k], held[k]) for k in held)
    assert await follower.apply(announce(4))
    assert engine.policy_version == 4
    assert all(torch.equal(engine.copied[4][k], versions[4][k]) for k in versions[4])
    assert not await follower.apply(announce(5))
    assert FETCH_FAILURES.value(reason="fetch") == before + 3
    assert engine.policy_version == 4
