"""A validated, queued set of new weights for a running model.

Validation happens when the update is offered (cheap metadata checks, in the caller's thread),
so a bad update is refused with an error naming the tensor and never half-applied; the copy
happens later, between two decode steps, in the engine's thread. Names are the model's
state_dict names; with tied embeddings `lm_head.weight` is accepted as an alias of
`model.embed_tokens.weight` and neither is required twice. The checks run against a
`ParamSpec` per name, so an engine whose model lives in another process (HttpEngine) refuses a
bad update with the same messages, before sending anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from slipstream.engine.interface import ParamSpec
from slipstream.engine.model import CausalLM

_TIED_ALIAS = {"lm_head.weight": "model.embed_tokens.weight"}


@dataclass
class WeightUpdate:
    """New values for some or all parameters (canonical names), tagged with a policy version."""

    version: int
    tensors: dict[str, Tensor]

    def merged(self, later: WeightUpdate) -> WeightUpdate:
        """This update followed by `later` (later values and version win)."""
        return WeightUpdate(version=later.version, tensors={**self.tensors, **later.tensors})

    def copy_into(self, model: CausalLM) -> None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, value in self.tensors.items():
                params[name].copy_(value, non_blocking=True)


def param_specs(model: CausalLM) -> dict[str, ParamSpec]:
    """Shape and dtype name (`float32`, ...) of every parameter; shared (tied) ones appear once."""
    return {name: ParamSpec(tuple(p.shape), dtype_name(p.dtype)) for name, p in model.named_parameters()}


def tied_aliases(model: CausalLM) -> dict[str, str]:
    """Names accepted in place of a canonical parameter name (lm_head -> embeddings when tied)."""
    return dict(_TIED_ALIAS) if model.config.tie_word_embeddings else {}


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> 'float32' (the name safetensors and configs use)."""
    return str(dtype).removeprefix("torch.")


def validate_update(model: CausalLM, version: int, tensors: Mapping[str, Tensor], *, partial: bool) -> WeightUpdate:
    """Check names, shapes and dtypes against `model`; raise ValueError naming the first bad tensor."""
    return validate_against(param_specs(model), tied_aliases(model), version, tensors, partial=partial)


def validate_against(
    specs: Mapping[str, ParamSpec],
    aliases: Mapping[str, str],
    version: int,
    tensors: Mapping[str, Tensor],
    *,
    partial: bool,
) -> WeightUpdate:
    """`validate_update` against a parameter description rather than a model in this process
    (an engine behind HTTP checks an update against the specs its server reported)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise ValueError(f"apply_weights: version must be an int, got {version!r}")
    canonical: dict[str, Tensor] = {}
    for name, value in tensors.items():
        target_name = aliases.get(name, name)
        target = specs.get(target_name)
        if target is None:
            raise ValueError(f"apply_weights: unknown tensor {name!r} (not a parameter of the model)")
        if not isinstance(value, Tensor):
            raise ValueError(f"apply_weights: tensor {name!r} is a {type(value).__name__}, not a torch.Tensor")
        if tuple(value.shape) != target.shape:
            raise ValueError(
                f"apply_weights: tensor {name!r} has shape {tuple(value.shape)}, the model expects {target.shape}"
            )
        if dtype_name(value.dtype) != target.dtype:
            raise ValueError(
                f"apply_weights: tensor {name!r} has dtype {value.dtype}, the model expects torch.{target.dtype}"
            )
        canonical[target_name] = value
    if not canonical:
        raise ValueError("apply_weights: no tensors given")
    if not partial:
        missing = sorted(set(specs) - set(canonical))
        if missing:
            raise ValueError(
                f"apply_weights: {len(missing)} tensors missing (first: {missing[0]!r}); "
                "pass every parameter or allow partial updates"
            )
    return WeightUpdate(version=version, tensors=canonical)
