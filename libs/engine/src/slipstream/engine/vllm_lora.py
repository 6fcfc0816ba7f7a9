"""LoRA versions on vLLM: which adapters a version may carry, and how an update splits into them.

A LoRA run publishes its adapters only (`…lora_A` [rank, in], `…lora_B` [out, rank]); vLLM reloads full
weights, so `VllmEngine` merges them (`lora.merge_adapters`) into the checkpoint for each version.
These two pure functions say what counts as an adapter and check an update's adapters by shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from slipstream.engine.interface import ParamSpec

if TYPE_CHECKING:
    from torch import Tensor


def adapter_specs(
    specs: Mapping[str, ParamSpec], targets: Sequence[str], rank: int, where: str | Path
) -> dict[str, ParamSpec]:
    """`…lora_A` [rank, in] and `…lora_B` [out, rank] of every 2-D checkpoint weight in `specs` whose
    module name ends in a target (the modules `attach_lora` wraps); {} when `rank` is 0. ValueError if a
    target matches nothing, as `attach_lora` says (`where` names the checkpoint)."""
    if not rank:
        return {}
    out: dict[str, ParamSpec] = {}
    found = dict.fromkeys(targets, 0)
    for name, spec in specs.items():
        module, _, leaf = name.rpartition(".")
        target = module.rpartition(".")[2]
        if leaf != "weight" or target not in found or len(spec.shape) != 2:
            continue
        out_features, in_features = spec.shape
        out[module + ".lora_A"] = ParamSpec((rank, in_features), "float32")
        out[module + ".lora_B"] = ParamSpec((out_features, rank), "float32")
        found[target] += 1
    unmatched = [t for t, n in found.items() if n == 0]
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no linear weight of {where}")
    return out


def split_adapters(
    adapters: Mapping[str, ParamSpec], tensors: Mapping[str, Tensor]
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """(the checkpoint's tensors, the LoRA adapters) of an update; adapters checked by shape against
    `adapters` (any floating dtype: they are merged in float32). ValueError naming a bad one."""
    from torch import Tensor

    if not adapters:
        return dict(tensors), {}
    rest: dict[str, Tensor] = {}
    found: dict[str, Tensor] = {}
    for name, value in tensors.items():
        spec = adapters.get(name)
        if spec is None:
            rest[name] = value
            continue
        if not isinstance(value, Tensor) or not value.is_floating_point():
            raise ValueError(f"apply_weights: adapter {name!r} must be a floating-point torch.Tensor")
        if tuple(value.shape) != spec.shape:
            raise ValueError(
                f"apply_weights: adapter {name!r} has shape {tuple(value.shape)}, the model expects {spec.shape}"
            )
        found[name] = value
    return rest, found
