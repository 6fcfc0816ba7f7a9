"""Snapshots round-trip bit-exactly, shards are verified, versions are write-once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.store import setup_store
from slipstream.store.config import StoreConfig
from slipstream.weights import CorruptShard, VersionExists, WeightsError, cut_shards, fetch_version, publish_snapshot

pytestmark = pytest.mark.unit


def _tensors(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(dtype),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g).to(dtype),
        "model.norm.weight": torch.ones(16, dtype=dtype),
    }


@pytest.fixture
def store(tmp_path: Path):
    return setup_store(StoreConfig(type="local", root=str(tmp_path / "store")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_snapshot_round_trip_is_bit_exact(store, dtype: torch.dtype) -> None:
    src = _tensors(dtype)
    key, manifest = publish_snapshot(store, run_id="r", version=3, tensors=src, shard_bytes=2048)
    assert len(manifest.shards) > 1  # the size bound cut it
    assert manifest.raw_bytes == sum(t.numel() * t.element_size() for t in src.values())
    got_manifest, got = fetch_version(store, key)
    assert got_manifest.policy_version == 3
    for name, t in src.items():
        assert got[name].dtype == dtype
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8))  # same bits


def test_tensor_never_splits_across_shards() -> None:
    enc = cut_shards(_tensors(torch.float32), shard_bytes=1024)
    for e in enc.tensors:
        assert e.offset + e.nbytes <= len(enc.shards[e.shard])


def test_flipped_byte_is_detected_and_nothing_returned(store) -> None:
    key, manifest = publish_snapshot(store, run_id="r", version=1, tensors=_tensors(torch.float32), shard_bytes=4096)
    victim = manifest.shards[1].key
    data = bytearray(store.get(victim))
    data[17] ^= 0x40
    store.put(victim, bytes(data))
    with pytest.raises(CorruptShard, match=victim):
        fetch_version(store, key)


def test_missing_shard_is_an_error(store) -> None:
    key, manifest = publish_snapshot(store, run_id="r", version=1, tensors=_tensors(torch.float32))
    store.delete(manifest.shards[0].key)
    with pytest.raises(WeightsError, match="missing shard"):
        fetch_version(store, key)


def test_versions_are_write_once(store) -> None:
    publish_snapshot(store, run_id="r", version=2, tensors=_tensors(torch.float32))
    with pytest.raises(VersionExists, match="version 2"):
        publish_snapshot(store, run_id="r", version=2, tensors=_tensors(torch.float32))
