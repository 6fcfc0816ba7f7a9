"""Which matmul kernel a bf16 forward uses on CPU: torch's own, or fp32 on upcast operands.

On a CPU without AVX-512 torch has no fast bf16 GEMM: `F.linear` on bf16 tensors falls back
to a scalar-ish kernel. Measured here (AMD EPYC, AVX2, one thread; x [16, 576] @ W^T [576,
1536]): fp32 0.61 ms, bf16 27 ms, bf16 operands upcast to fp32 then the result rounded back
to bf16 0.80 ms. The upcast computes the same thing as the bf16 kernel: bf16 inputs and
weights (widening is exact), products accumulated in fp32, one rounding of the result to
bf16; only the summation order may differ, as between any two GEMM kernels. Weights stay
stored in bf16 (what `apply_weights` copies into, what the cache holds); they are widened per
call, which costs little next to the GEMM itself and can never go stale.

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


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, upcast: bool) -> Tensor:
    """`F.linear`, or (upcast) the same product in fp32 rounded back to x's dtype."""
    if not upcast:
        return F.linear(x, weight, bias)
    return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)


def project(proj: nn.Module, x: Tensor, upcast: bool) -> Tensor:
    """Apply a projection module (`nn.Linear`, or a LoRA-wrapped one) with the chosen kernel."""
    if not upcast:
        return proj(x)
    if type(proj) is nn.Linear:
        return linear(x, proj.weight, proj.bias, True)
    # A LoraLinear (imported lazily by type name would be a cycle): it takes the flag itself.
    return proj(x, upcast=True)
