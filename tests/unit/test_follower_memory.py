"""The follower decodes each version into the memory of the version it held before last, once that is free.

Free means the engine switched past it: a version whose apply timed out may still be pending in
the engine, so its memory is not written over.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from slipstream.rollout_worker.follower import WeightFollower
from slipstream.schemas import WeightAnnounce
from slipstream.store import LocalObjectStore
from slipstream.weights import manifest_key, publish_version

pytestmark = pytest.mark.unit

RUN = "r"


class Engine:
    """Switches to a version as soon as it is handed over, unless told to hang."""

    def __init__(self) -> None:
        self.policy_version = 0
        self.hang = False
        self.copied: dict[int, dict[str, torch.Tensor]] = {}

    def apply_weights(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        if not self.hang:
            self.copied[version] = {k: v.clone() for k, v in tensors.items()}
            self.policy_version = version

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return []  # _cast passes the tensors through as decoded

    def stats(self) -> dict[str, float]:
        return {"last_weight_apply_ms": 0.0}


def _versions(n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    v = {"a": torch.randn(4096, generator=g).bfloat16(), "b": torch.randn(64, 64, generator=g).bfloat16()}
    out = [v]
    for _ in range(n - 1):
        v = {k: (t.float() + 0.01 * torch.randn(t.shape, generator=g)).bfloat16() for k, t in v.items()}
        out.append(v)
    return out


def _ptrs(tensors: dict[str, torch.Tensor]) -> set[int]:
    return {t.data_ptr() for t in tensors.values()}


async def test_versions_decode_into_the_memory_of_the_one_held_before_last(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "store")
    versions = _versions(6)
    for v, tensors in enumerate(versions):
        base = None if v == 0 else (v - 1, versions[v - 1])
        publish_version(store, run_id=RUN, version=v, tensors=tensors, base=base, threads=1)
    engine = Engine()
    follower = WeightFollower(cast(Any, None), store, cast(Any, engine), run_id=RUN, retries=0, backoff_s=0.0)
    follower.apply_timeout_s = 0.2

    def announce(v: int) -> WeightAnnounce:
        return WeightAnnounce(policy_version=v, manifest_key=manifest_key(RUN, v), run_id=RUN)

    held: dict[int, set[int]] = {}
    for v in (1, 2, 3):
        assert await follower.apply(announce(v))
        assert follower._held is not None
        held[v] = _ptrs(follower._held[1])
        assert all(torch.equal(engine.copied[v][k], versions[v][k]) for k in versions[v])
    assert held[3] == held[1]  # version 3 was decoded where version 1 lived
    assert not held[2] & held[1]

    # Version 4 never reaches the engine: version 3's memory may still be read, so version 5 must
    # not be decoded into it.
    engine.hang = True
    assert not await follower.apply(announce(4))
    engine.hang = False
    assert await follower.apply(announce(5))
    assert follower._held is not None
    assert not _ptrs(follower._held[1]) & held[3]
    assert all(torch.equal(engine.copied[5][k], versions[5][k]) for k in versions[5])
