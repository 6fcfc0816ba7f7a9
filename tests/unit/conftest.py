"""Fixtures the unit tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the module: OpenMP spin-waiting across 2 threads on two shared cores is
    10-50x slower than one under load."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
