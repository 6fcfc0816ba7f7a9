"""The learner -> publisher hand-off: atomic, ordered, metadata preserved."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from slipstream.weights.staging import list_staged, load_staged, stage

pytestmark = pytest.mark.unit


def test_staged_versions_come_back_in_order_with_metadata(tmp_path: Path) -> None:
    for v in (3, 1, 2):
        stage(tmp_path, v, {"w": torch.full((2, 2), float(v))}, step_finished_at=100.0 + v)
    (tmp_path / ".v00000004.safetensors.123.tmp").write_bytes(b"partial")  # an in-progress write
    staged = list_staged(tmp_path)
    assert [s.version for s in staged] == [1, 2, 3]
    assert [s.step_finished_at for s in staged] == [101.0, 102.0, 103.0]
    assert torch.equal(load_staged(staged[2])["w"], torch.full((2, 2), 3.0))


def test_empty_or_missing_dir_has_nothing_staged(tmp_path: Path) -> None:
    assert list_staged(tmp_path / "nope") == []
