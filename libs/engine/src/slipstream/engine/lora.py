"""LoRA: low-rank adapters on a frozen base, kept unmerged in the learner and in the engine alike.

`attach_lora(model, rank, alpha, targets, seed)` replaces each targeted `nn.Linear` (by module
name suffix: `q_proj`, `down_proj`, ...) with a `LoraLinear` that keeps the base weight under its
HF name (`...q_proj.weight`, frozen) and adds two parameters, `...q_proj.lora_A` [rank, in] and
`...q_proj.lora_B` [out, rank]; its output is `base(x) + (alpha / rank) * x A^T B^T`. A starts
random (seeded, so every process builds the same version 0) and B at zero, so version 0 computes
exactly the base model.

The adapters stay unmerged everywhere, on purpose:
- in bf16 rollouts a merged `W + s·BA` would round the small update away (bf16 keeps 8 bits of
  mantissa: the same reason pure-bf16 training barely learns), while the separate low-rank path
  carries it at full relative precision;
- a published version is then just the adapter tensors, which the weight codec moves, verifies
  and applies bit-exactly like any other tensors (the worker's digest covers base and adapters).
The extra cost is two thin matmuls per targeted projection.

The exception is vLLM (`VllmEngine`), which serves full weights only: there `merge_adapters` folds the
newest adapters into the frozen base in float32 for every version, and the full checkpoint is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from slipstream.engine.kernels import WeightCache, linear

DEFAULT_TARGETS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_SUFFIXES: tuple[str, ...] = (".lora_A", ".lora_B")


class LoraLinear(nn.Linear):
    """An `nn.Linear` (frozen) plus a trainable low-rank update; parameter names stay HF's."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float, generator: torch.Generator | None = None) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        self.rank = rank
        self.scale = alpha / rank
        dtype, device = base.weight.dtype, base.weight.device
        a = torch.empty(rank, self.in_features, dtype=torch.float32)
        # PEFT's init: kaiming-uniform A (a = sqrt(5)), zero B.
        bound = 1.0 / math.sqrt(self.in_features)
        a.uniform_(-bound, bound, generator=generator)
        self.lora_A = nn.Parameter(a.to(device=device, dtype=dtype))
        self.lora_B = nn.Parameter(torch.zeros(self.out_features, rank, dtype=dtype, device=device))

    def forward(self, x: Tensor, kernel: WeightCache | None = None) -> Tensor:
        """`kernel`: run the three products with that matmul kernel (see `kernels.py`)."""
        low = linear(linear(x, self.lora_A, None, kernel), self.lora_B, None, kernel)
        return linear(x, self.weight, self.bias, kernel) + low * self.scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, scale={self.scale:g}"


def attach_lora(
    model: nn.Module, *, rank: int, alpha: float, targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0
) -> list[str]:
    """Wrap every `nn.Linear` whose name ends in one of `targets`; freeze everything else.

    Returns the wrapped module names. Raises ValueError when a target matches nothing (a typo
    must not silently train nothing) or when the model already has adapters.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if any(isinstance(m, LoraLinear) for m in model.modules()):
        raise ValueError("the model already has LoRA adapters")
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.requires_grad_(False)
    wrapped: list[str] = []
    found = dict.fromkeys(targets, 0)
    for name, module in list(model.named_modules()):
        leaf = name.rpartition(".")[2]
        if leaf not in found or not isinstance(module, nn.Linear):
            continue
        parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        setattr(parent, leaf, LoraLinear(module, rank, alpha, generator))
        found[leaf] += 1
        wrapped.append(name)
    unmatched = [t for t, n in found.items() if n == 0]
    if unmatched:
        raise ValueError(f"LoRA targets {unmatched} match no linear layer of the model")
    return wrapped


def is_adapter(name: str) -> bool:
    """Whether a parameter name is a LoRA adapter's."""
    return name.endswith(ADAPTER_SUFFIXES)


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters' tensors by name (what a LoRA run publishes and checkpoints)."""
    return {name: p for name, p in model.named_parameters() if is_adapter(name)}


def merged_weight(layer: LoraLinear) -> Tensor:
    """`W + scale · B A` in float32 (for exports and checks; TorchEngine never merges, `merge_adapters` is vLLM's)."""
    delta = layer.lora_B.float() @ layer.lora_A.float()
    return layer.weight.float() + layer.scale * delta


def merge_adapters(
    base: Mapping[str, Tensor], adapters: Mapping[str, Tensor], scale: float, dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """`{module.weight: W + scale · B A}` for every module whose `.lora_A` and `.lora_B` are both in `adapters`.

    For an engine that serves full weights only (vLLM): the base `W` comes from `base` (the frozen
    checkpoint, by HF name), the product is taken in float32 and the result cast to `dtype`. A module
    with only one of its two adapters, or none of its base weight, or shapes that do not chain
    (`A` [rank, in], `B` [out, rank], `W` [out, in]), is a ValueError naming it.
    """
    modules: dict[str, dict[str, Tensor]] = {}
    for name, value in adapters.items():
        prefix, _, kind = name.rpartition(".")
        if kind not in ("lora_A", "lora_B") or not prefix:
            raise ValueError(f"merge_adapters: {name!r} is not a LoRA adapter (…lora_A / …lora_B)")
        modules.setdefault(prefix, {})[kind] = value
    merged: dict[str, Tensor] = {}
    for prefix, pair in sorted(modules.items()):
        if len(pair) != 2:
            missing = "lora_B" if "lora_A" in pair else "lora_A"
            raise ValueError(f"merge_adapters: {prefix}.{missing} is missing (both adapters are needed to merge)")
        weight = base.get(prefix + ".weight")
        if weight is None:
            raise ValueError(f"merge_adapters: no base weight {prefix + '.weight'!r} for its adapters")
        a, b = pair["lora_A"], pair["lora_B"]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0] or (b.shape[0], a.shape[1]) != tuple(weight.shape):
            raise ValueError(
                f"merge_adapters: {prefix}: lora_B {tuple(b.shape)} @ lora_A {tuple(a.shape)} does not give the "
                f"weight's shape {tuple(weight.shape)}"
            )
        delta = b.detach().to(torch.float32) @ a.detach().to(torch.float32)
        merged[prefix + ".weight"] = (weight.detach().to(torch.float32) + scale * delta).to(dtype)
    return merged
