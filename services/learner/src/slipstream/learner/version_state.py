"""What one version of the policy is: its own tensors (`unique_state`), the dtypes it may be staged in,
and how a whole model is staged as one version (`stage_model`).

Its own module because the hand-off stages it, checkpoints save it and the rank groups partition
and stage it; the hand-off's module, which builds on the rank groups (`group.py`), would otherwise
close a circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from slipstream.weights.staging import stage

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a version of `model` is: its state dict without aliases of an already listed tensor (tied
    weights) and, when some parameters are frozen (LoRA), without the frozen ones."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    trainable = any(p.requires_grad for p in model.parameters())
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if trainable and name in frozen:
            continue
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def stage_model(
    staging_dir: str | Path,
    version: int,
    model: nn.Module,
    *,
    dtype: str = "",
    step_finished_at: float,
    extra: Mapping[str, str] | None = None,
) -> Path:
    """Stage `version` of the whole of `model` (its `unique_state`, floating tensors cast to `dtype` unless
    empty) into `staging_dir` for a weight-publisher; `extra` goes into the file's metadata. Blocking."""
    if dtype and dtype not in DTYPES:
        raise ValueError(f"staged weights dtype {dtype!r} is not one of {', '.join(DTYPES)} (or empty)")
    target = DTYPES.get(dtype)
    tensors = unique_state(model)
    if target is not None:
        tensors = {k: v.detach().to(target) if v.is_floating_point() else v for k, v in tensors.items()}
    return stage(staging_dir, version, tensors, step_finished_at=step_finished_at, extra=dict(extra or {}))
