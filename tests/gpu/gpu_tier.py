"""What the gpu tier runs on, its sizes per device, and the figures it reports.

The tier runs on CUDA when torch sees a device. `SLIPSTREAM_GPU_TIER_DEVICE=cpu` runs the same
tests on the CPU as a dry run (a smaller preset, gloo instead of NCCL), so the tier's code is
exercised on machines without a GPU; otherwise, without CUDA, every test skips.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEVICE_ENV = "SLIPSTREAM_GPU_TIER_DEVICE"
JSON_ENV = "SLIPSTREAM_GPU_TIER_JSON"

# Dense bf16 tensor-core peaks (no sparsity) from the vendors' datasheets, by a substring of
# torch.cuda.get_device_name(); the first match wins, so the more specific names come first.
PEAK_BF16_FLOPS: list[tuple[str, float]] = [
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM (e.g. "NVIDIA H100 80GB HBM3")
    ("H200", 989e12),
    ("GH200", 989e12),
    ("A100", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
]


@dataclass(frozen=True)
class Sizes:
    """How big the tier's work is on a device: the preset, and the batches the tests time."""

    preset: str
    engine_requests: int
    prompt_len: int
    new_tokens: int
    groups: int
    group_size: int
    completion_len: int
    timed_steps: int


CUDA_SIZES = Sizes(
    preset="25m",
    engine_requests=32,
    prompt_len=64,
    new_tokens=128,
    groups=8,
    group_size=8,
    completion_len=448,
    timed_steps=5,
)
# The dry run only proves the code paths: small enough for a shared 2-core CPU.
CPU_SIZES = Sizes(
    preset="tiny",
    engine_requests=4,
    prompt_len=16,
    new_tokens=24,
    groups=2,
    group_size=2,
    completion_len=32,
    timed_steps=2,
)


def requested_device() -> str | None:
    """ "cuda", "cpu" (the dry run), or None when the tier cannot run here (the skip reason follows)."""
    wanted = os.environ.get(DEVICE_ENV, "")
    if wanted not in ("", "cpu", "cuda"):
        raise ValueError(f"{DEVICE_ENV} must be 'cpu' or 'cuda' (or unset), got {wanted!r}")
    if wanted == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else None


def sizes_for(device: str) -> Sizes:
    return CUDA_SIZES if device == "cuda" else CPU_SIZES


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu ({torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads)"


def peak_bf16_flops(name: str) -> float | None:
    """The device's dense bf16 peak in FLOP/s, or None when the table does not know it."""
    for key, peak in PEAK_BF16_FLOPS:
        if key in name:
            return peak
    return None


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the peak (None without a known peak)."""
    if peak is None or seconds <= 0:
        return None
    return flops / seconds / peak


def mfu_text(value: float | None) -> str:
    return "unknown peak" if value is None else f"{100 * value:.2f}%"


class Figures:
    """The tier's measurements: printed as they come, and written as JSON at the end when asked."""

    def __init__(self, device: str) -> None:
        self.data: dict[str, Any] = {"device": device, "device_name": device_name(device)}
        peak = peak_bf16_flops(self.data["device_name"]) if device == "cuda" else None
        self.data["peak_bf16_flops"] = peak
        self.peak = peak

    def record(self, test: str, **figures: Any) -> None:
        self.data[test] = figures
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items())
        print(f"\n[gpu tier] {test} on {self.data['device_name']}: {shown}")

    def write(self) -> Path | None:
        target = os.environ.get(JSON_ENV, "")
        if not target:
            return None
        path = Path(target)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.data, indent=2, sort_keys=True) + "\n")
        return path


def scored_groups(sizes: Sizes, seed: int = 3) -> list[list[Any]]:
    """`sizes.groups` groups of `sizes.group_size` scored trajectories of random byte tokens, with
    rewards that differ within each group (so every advantage is non-zero)."""
    import math

    import torch

    from slipstream.schemas import (
        PolicySegment,
        ScoredTrajectory,
        Trajectory,
        pack_floats,
        pack_ids,
        pack_mask,
        scored_episode_from_v1,
    )

    gen = torch.Generator().manual_seed(seed)
    groups: list[list[Any]] = []
    for g in range(sizes.groups):
        prompt = torch.randint(3, 259, (sizes.prompt_len,), generator=gen).tolist()
        group = []
        for i in range(sizes.group_size):
            completion = torch.randint(3, 259, (sizes.completion_len,), generator=gen).tolist()
            n = len(completion)
            traj = Trajectory(
                trajectory_id=f"g{g}-{i}",
                task_id=f"t{g}",
                env="arith",
                group_id=f"t{g}/g",
                group_size=sizes.group_size,
                prompt_len=len(prompt),
                token_ids=pack_ids(prompt + completion),
                logprobs=pack_floats([-math.log(259.0)] * n),
                loss_mask=pack_mask([1] * n),
                segments=[PolicySegment(0, n)],
            )
            reward = float(i) / max(1, sizes.group_size - 1)
            group.append(scored_episode_from_v1(ScoredTrajectory(trajectory=traj, reward=reward, correct=reward > 0.5)))
        groups.append(group)
    return groups


def sequence_tokens(sizes: Sizes) -> int:
    """Tokens one learner step runs through forward and backward (prompt and completion alike)."""
    return sizes.groups * sizes.group_size * (sizes.prompt_len + sizes.completion_len)
