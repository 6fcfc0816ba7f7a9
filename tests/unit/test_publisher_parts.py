"""The weight-publisher's per-rank store (`PartStore`) on a local object store, both ranks in threads.

Rank 0 commits a version once rank 1's part is in, abandons one whose part never comes, and
both then encode the next version against the last committed one; a rank-1 part whose version
rank 0 went past without ever having it is dropped instead of waiting forever.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from slipstream.store import LocalObjectStore
from slipstream.weight_publisher.parts import ORPHANED, PartPending, PartStore, VersionAbandoned
from slipstream.weights import load_version, read_manifest
from slipstream.weights.layout import manifest_key
from slipstream.weights.parts import abandon, fate

pytestmark = pytest.mark.unit
RUN = "r"
NAMES = [["a"], ["b"]]


def weights(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"a": torch.randn(64, generator=g), "b": torch.randn(8, 8, generator=g).bfloat16()}


def part_store(store: LocalObjectStore, rank: int, timeout_s: float = 5.0) -> PartStore:
    return PartStore(
        store, run_id=RUN, rank=rank, ranks=2, part_timeout_s=timeout_s, poll_s=0.01, shard_bytes=1 << 20, threads=1
    )


def publish(ps: PartStore, version: int):  # type: ignore[no-untyped-def]
    full = weights(version)
    return ps.publish(version=version, load=lambda: {n: full[n] for n in NAMES[ps.rank]}, step_finished_at=1.0)


def both(ranks: list[PartStore], version: int) -> list[object]:
    out: list[object] = [None, None]

    def run(r: int) -> None:
        try:
            out[r] = publish(ranks[r], version)
        except Exception as exc:  # handed back to the assertions
            out[r] = exc

    threads = [threading.Thread(target=run, args=(r,)) for r in (1, 0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_rank_zero_commits_abandons_and_both_go_on_from_the_last_committed_version(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    ranks = [part_store(store, 0, timeout_s=0.3), part_store(store, 1, timeout_s=0.3)]
    first = both(ranks, 0)
    assert first[1] is None and first[0].version == 0 and not first[0].already_stored  # type: ignore[attr-defined]
    # Version 1: rank 1's part never comes; rank 0 abandons it after part_timeout_s.
    with pytest.raises(VersionAbandoned, match=r"no part from rank\(s\) \[1\]"):
        publish(ranks[0], 1)
    assert fate(store, RUN, 1) == "abandoned"
    with pytest.raises(VersionAbandoned, match="abandoned"):
        publish(ranks[1], 1)  # its part comes late: dropped
    second = both(ranks, 2)
    m = read_manifest(store, manifest_key(RUN, 2))
    assert (m.keyframe, m.base_version) == (False, 0)  # a delta on the last committed version, from both ranks
    assert [p.base_version for p in m.parts] == [0, 0] and second[1] is None
    got = load_version(store, RUN, 2)
    assert all(torch.equal(got[n], weights(2)[n]) for n in ("a", "b"))
    # A retry of a committed version re-announces it (rank 0) and uploads nothing.
    again = publish(ranks[0], 2)
    assert again is not None and again.already_stored


def test_a_part_of_a_version_rank_zero_went_past_is_dropped_not_waited_for_forever(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    rank1 = part_store(store, 1, timeout_s=0.05)
    with pytest.raises(PartPending, match="not committed or abandoned"):
        publish(rank1, 5)  # nothing is known beyond it: keep waiting (the publish loop retries)
    abandon(store, RUN, 6, "rank 1's part never came", [1])
    before = ORPHANED.value()
    with pytest.raises(VersionAbandoned, match="settled version 6 and never this one"):
        publish(rank1, 5)
    assert ORPHANED.value() == before + 1
    rank1.stopping = lambda: True
    with pytest.raises(PartPending, match="stopping"):
        publish(rank1, 7)
