"""The gpu tier: every test here is marked `gpu` and skips, cheaply, without a CUDA device.

`SLIPSTREAM_GPU_TIER_DEVICE=cpu` runs the tier on the CPU instead (see gpu_tier.py). Figures are
printed and, with `SLIPSTREAM_GPU_TIER_JSON=<path>`, written there as one JSON object.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from gpu_tier import DEVICE_ENV, Figures, Sizes, requested_device, sizes_for

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [item for item in items if _HERE in Path(str(item.path)).parents]
    if not ours or requested_device() is not None:
        return
    skip = pytest.mark.skip(reason=f"gpu tier: no CUDA device (set {DEVICE_ENV}=cpu for the CPU dry run)")
    for item in ours:
        item.add_marker(skip)


@pytest.fixture(scope="session")
def tier_device() -> str:
    device = requested_device()
    assert device is not None, "collection skips the gpu tier without a device"
    return device


@pytest.fixture(scope="session")
def sizes(tier_device: str) -> Sizes:
    return sizes_for(tier_device)


@pytest.fixture(scope="session")
def figures(tier_device: str) -> Iterator[Figures]:
    out = Figures(tier_device)
    yield out
    path = out.write()
    if path is not None:
        print(f"\n[gpu tier] figures written to {path}")
