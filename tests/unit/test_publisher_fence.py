"""The weight-publisher's fence: the verdict table, the staged-file metadata it reads, and the learner's writer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from torch import nn

from slipstream.control import ControlUnavailable, LeaseInfo
from slipstream.learner import leadership
from slipstream.learner.handoff import WeightHandoff
from slipstream.weight_publisher import fence as fence_mod
from slipstream.weight_publisher.fence import (
    Fence,
    Fenced,
    FenceWait,
    StagedFence,
    Verdict,
    read_fence,
    verdict,
)
from slipstream.weights.staging import list_staged, stage

pytestmark = pytest.mark.unit

MINE = StagedFence("learner-a:1f2e3d", 5)


@pytest.mark.parametrize(
    ("fence", "lease", "expected", "reason"),
    [
        (None, None, Verdict.PUBLISH, "unfenced"),
        (MINE, None, Verdict.WAIT, "lease_vacant"),
        (MINE, LeaseInfo("learner-a:1f2e3d", 5, 8.0), Verdict.PUBLISH, "leader"),
        (MINE, LeaseInfo("learner-a:1f2e3d", 6, 8.0), Verdict.PUBLISH, "leader"),  # took its own lapsed lease back
        (MINE, LeaseInfo("learner-a:1f2e3d", 5, 0.2), Verdict.WAIT, "lease_expiring"),
        (MINE, LeaseInfo("learner-a:1f2e3d", 4, 8.0), Verdict.FENCED, "lease token 4 is below the staged token 5"),
        (MINE, LeaseInfo("learner-b:9a8b7c", 6, 8.0), Verdict.FENCED, "lease held by 'learner-b:9a8b7c' (token 6)"),
    ],
)
def test_verdict(fence: StagedFence | None, lease: LeaseInfo | None, expected: Verdict, reason: str) -> None:
    decision = verdict(fence, lease, min_remaining_s=0.5)
    assert decision.verdict is expected and decision.reason.startswith(reason)


def test_the_learner_writes_the_fence_the_publisher_reads(tmp_path: Path) -> None:
    assert (leadership.FENCE_TOKEN_KEY, leadership.LEASE_HOLDER_KEY) == (
        fence_mod.FENCE_TOKEN_KEY,
        fence_mod.LEASE_HOLDER_KEY,
    )
    handoff = WeightHandoff(tmp_path)
    path = handoff.stage(3, nn.Linear(2, 2), fence={"fence_token": "5", "lease_holder": "learner-a:1f2e3d"})
    assert read_fence(path) == MINE
    assert [s.version for s in list_staged(tmp_path)] == [3]
    assert read_fence(handoff.stage(4, nn.Linear(2, 2))) is None  # a learner without a control plane


def test_a_malformed_fence_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = stage(tmp_path, 1, {"w": torch.zeros(2)}, extra={"fence_token": "five", "lease_holder": "x"})
    with pytest.raises(ValueError, match=r"v00000001\.safetensors has a malformed fence: fence_token='five'"):
        read_fence(path)


class FakeLease:
    def __init__(self) -> None:
        self.answer: LeaseInfo | Exception | None = None

    async def current(self) -> LeaseInfo | None:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class FakeControl:
    def __init__(self) -> None:
        self.view = FakeLease()

    def lease(self, holder_id: str | None = None, ttl_s: float = 10.0) -> FakeLease:
        return self.view


def test_admit_raises_wait_or_fenced_and_counts_them() -> None:
    control = FakeControl()
    gate = Fence(control, min_remaining_s=0.5)  # type: ignore[arg-type]
    waits, fenced = fence_mod.WAITS.total(), fence_mod.FENCED.total()

    async def admit() -> None:
        await gate.admit(MINE, 3)

    asyncio.run(gate.admit(None, 1))  # unfenced: never asks Redis
    control.view.answer = ControlUnavailable("redis://x", "lease.inspect", ConnectionRefusedError())
    with pytest.raises(FenceWait, match="version 3: the control plane is unreachable"):
        asyncio.run(admit())
    control.view.answer = LeaseInfo("learner-b:9a8b7c", 6, 8.0)
    with pytest.raises(Fenced, match="staged by 'learner-a:1f2e3d' under token 5"):
        asyncio.run(admit())
    control.view.answer = LeaseInfo("learner-a:1f2e3d", 5, 8.0)
    asyncio.run(admit())
    assert (fence_mod.WAITS.total() - waits, fence_mod.FENCED.total() - fenced) == (1, 1)
