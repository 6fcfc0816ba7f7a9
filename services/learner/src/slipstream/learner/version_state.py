"""What one version of the policy is: its own tensors (`unique_state`) and the dtypes it may be staged in.

Its own module because the hand-off stages it, checkpoints save it and the rank group partitions
it; the hand-off's module, which builds on the rank group, would otherwise close a circle.
"""

from __future__ import annotations

import torch
from torch import nn

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
