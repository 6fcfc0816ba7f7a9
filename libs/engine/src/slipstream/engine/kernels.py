"""Which matmul kernel a bf16 forward uses on CPU: torch's own, or fp32 on upcast operands.

On a CPU without AVX-512 torch has no fast bf16 GEMM: `F.linear` on bf16 tensors falls back
to a scalar-ish kernel. Measured here (AMD EPYC, AVX2, one thread; x [16, 576] @ W^T [576,
1536]): fp32 0.61 ms, bf16 27 ms, bf16 operands upcast to fp32 then the result rounded back
to bf16 0.80 ms. The upcast computes the same thing as the bf16 kernel: bf16 inputs and
weights (widening is exact), products accumulated in fp32, one rounding of the result to
bf16; only the summation order may differ, as between any two GEMM kernels.

Weights stay stored in bf16 (what `apply_weights` copies into, what the learner publishes);
`Fp32Weights` keeps an fp32 copy of each, made on first use. Widening every weight at every
step instead cost a third of a bf16 decode step (batch 16, SmolLM2: 0.9 s of 2.8 s of profiled
CPU time in `copy_`); the copies cost 4 bytes per parameter of memory (0.54 GB for SmolLM2).
A copy is remade when its weight changes in place (the tensor's version counter moves), and
the engine drops them all whenever it applies new weights.

`upcast_bf16_default(device)` decides per device; the engine's `bf16_upcast` option overrides.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def upcast_bf16_default(device: torch.device) -> bool:
    """True where bf16 matmuls should run as fp32: an x86 CPU whose torch kernels stop at AVX2.

    With AVX-512 torch hands bf16 GEMMs to oneDNN, which is fast; other architectures keep
    their own kernels (unmeasured here, so left alone).
    """
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")


class Fp32Weights:
    """fp32 copies of bf16 weights for upcast matmuls, one per weight tensor, made on first use."""

    def __init__(self) -> None:
        # id(weight) -> (weight, its version counter when copied, the fp32 copy). Holding the
        # weight itself keeps its id from being reused by another tensor.
        self._copies: dict[int, tuple[Tensor, int, Tensor]] = {}

    def __call__(self, weight: Tensor) -> Tensor:
        hit = self._copies.get(id(weight))
        if hit is not None and hit[0] is weight and hit[1] == weight._version:
            return hit[2]
        wide = weight.detach().float()
        self._copies[id(weight)] = (weight, weight._version, wide)
        return wide

    def clear(self) -> None:
        """Forget every copy (new weights were applied; `.data` writes bypass version counters)."""
        self._copies.clear()

    @property
    def nbytes(self) -> int:
        return sum(wide.numel() * wide.element_size() for _, _, wide in self._copies.values())


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, upcast: Fp32Weights | None) -> Tensor:
    """`F.linear`, or (upcast) the same product in fp32 rounded back to x's dtype."""
    if upcast is None:
        return F.linear(x, weight, bias)
    wide_bias = None if bias is None else bias.float()
    return F.linear(x.float(), upcast(weight), wide_bias).to(x.dtype)


def project(proj: nn.Module, x: Tensor, upcast: Fp32Weights | None) -> Tensor:
    """Apply a projection module (`nn.Linear`, or a LoRA-wrapped one) with the chosen kernel."""
    if upcast is None:
        return proj(x)
    if type(proj) is nn.Linear:
        return linear(x, proj.weight, proj.bias, upcast)
    # A LoraLinear (importing its type here would be a cycle): it takes the weights itself.
    return proj(x, upcast=upcast)
