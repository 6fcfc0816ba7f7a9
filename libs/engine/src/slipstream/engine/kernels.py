"""Which matmul kernel the engine's cached forward uses on CPU, and the weight copies it needs.

Two choices besides torch's own `F.linear`, each a cache of per-weight copies made on first use:

- `Fp32Weights` (bf16 models): on a CPU without AVX-512 torch has no fast bf16 GEMM: `F.linear`
  on bf16 tensors falls back to a scalar-ish kernel. Measured here (AMD EPYC, AVX2, one thread;
  x [16, 576] @ W^T [576, 1536]): fp32 0.61 ms, bf16 27 ms, bf16 operands upcast to fp32 then
  the result rounded back to bf16 0.80 ms. The upcast computes the same thing as the bf16
  kernel: bf16 inputs and weights (widening is exact), products accumulated in fp32, one
  rounding of the result to bf16; only the summation order may differ, as between any two GEMM
  kernels. Weights stay stored in bf16 (what `apply_weights` copies into, what the learner
  publishes); widening every weight at every step instead cost a third of a bf16 decode step
  (batch 16, SmolLM2: 0.9 s of 2.8 s of profiled CPU time in `copy_`); the copies cost 4 bytes
  per parameter (0.54 GB for SmolLM2).
- `MklPackedWeights` (fp32 models): MKL's packed GEMM (`cblas_sgemm_pack` once per weight, then
  `cblas_sgemm_compute`, exposed by torch as `torch.ops.mkl._mkl_reorder_linear_weight` and
  `_mkl_linear`) skips the per-call repacking of W that a plain GEMM does, which dominates at
  the few rows of a decode step. Measured on a shared 2-core Intel Xeon (AVX-512), one thread,
  load 3-6, x [M, K] @ W^T alone in a loop: M=16 K=576 N=576 0.27 → 0.07 ms, N=1536 0.50 →
  0.26 ms, lm_head N=49152 21-47 → 14-29 ms; M=64 ~1.2x, lm_head 1.5x; M=2048 (a prefill
  chunk) within noise (0.9-1.06x), so calls above `PACKED_MAX_ROWS` rows keep `F.linear`. In
  a whole SmolLM2 decode step, where each weight is read once per step rather than reused from
  cache, the gain is smaller: 1.22x at batch 16, 1.10x at 64 (paired steps, same process).
  HF `generate` does not use it. A packed copy costs what the weight does (+1 %). torch's
  `_mkl_linear` falls back to `F.linear` unless the input's row count equals its `batch_size`
  argument; that argument only selects the path: MKL's packed layout of W does not depend on
  it (the same buffer size for any M; weights packed for 16 and for 64 rows give bit-identical
  outputs at 1 to 2048 rows; tests/unit/test_engine_mkl_pack.py holds packed = F.linear at
  several row counts after packing for another), so one packed copy serves every batch size.

Both caches remake a copy when its weight changes in place (the tensor's version counter
moves), and the engine drops them all whenever it applies new weights (`.data` writes bypass
version counters). `choose_kernel` picks the cache per device and dtype (`upcast_bf16_default`,
`mkl_pack_available`); the engine's `bf16_upcast` and `mkl_pack` options override.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# Most rows (batch x tokens) a matmul sends to MKL's packed GEMM; larger ones (prefill chunks)
# gained nothing measurable from it.
PACKED_MAX_ROWS = 256


def upcast_bf16_default(device: torch.device) -> bool:
    """True where bf16 matmuls should run as fp32: an x86 CPU whose torch kernels stop at AVX2.

    With AVX-512 torch hands bf16 GEMMs to oneDNN, which is fast; other architectures keep
    their own kernels (unmeasured here, so left alone).
    """
    return device.type == "cpu" and torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT")


def mkl_pack_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether MKL's packed GEMM can run: an fp32 model on a CPU build of torch linked with MKL."""
    return device.type == "cpu" and dtype == torch.float32 and torch.backends.mkl.is_available()


class WeightCache:
    """Per-weight copies in the form a kernel wants, one per weight tensor, made on first use."""

    # Whether the kernel computes in fp32 on widened low-precision operands (attention follows).
    upcast = False

    def __init__(self) -> None:
        # id(weight) -> (weight, its version counter when copied, the copy). Holding the weight
        # itself keeps its id from being reused by another tensor.
        self._copies: dict[int, tuple[Tensor, int, Tensor]] = {}

    def copy_of(self, weight: Tensor, rows: int = 0) -> Tensor:
        """The cached copy of `weight`, remade if the weight changed in place since (`rows`: the
        row count of the call that makes it, for a kernel whose copy is tuned to one)."""
        hit = self._copies.get(id(weight))
        if hit is not None and hit[0] is weight and hit[1] == weight._version:
            return hit[2]
        made = self._make(weight.detach(), rows)
        self._copies[id(weight)] = (weight, weight._version, made)
        return made

    def _make(self, weight: Tensor, rows: int) -> Tensor:
        raise NotImplementedError

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """`F.linear(x, weight, bias)` computed with this kernel."""
        raise NotImplementedError

    def clear(self) -> None:
        """Forget every copy (new weights were applied; `.data` writes bypass version counters)."""
        self._copies.clear()

    def __len__(self) -> int:
        return len(self._copies)


class Fp32Weights(WeightCache):
    """fp32 copies of bf16 weights for upcast matmuls."""

    upcast = True

    def __call__(self, weight: Tensor) -> Tensor:
        return self.copy_of(weight)

    def _make(self, weight: Tensor, rows: int) -> Tensor:
        return weight.float()

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """The same product in fp32 on the widened operands, rounded back to x's dtype."""
        wide_bias = None if bias is None else bias.float()
        return F.linear(x.float(), self.copy_of(weight), wide_bias).to(x.dtype)

    @property
    def nbytes(self) -> int:
        return sum(wide.numel() * wide.element_size() for _, _, wide in self._copies.values())


class MklPackedWeights(WeightCache):
    """fp32 weights packed for MKL's packed GEMM (no autograd: the engine's forward only)."""

    def _make(self, weight: Tensor, rows: int) -> Tensor:
        # Packed for the first call's row count, as torch does; the layout serves any other.
        return torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)

    def linear(self, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 0 < rows <= PACKED_MAX_ROWS:
            return F.linear(x, weight, bias)
        return torch.ops.mkl._mkl_linear(x, self.copy_of(weight, rows), weight, bias, rows)


def choose_kernel(
    device: torch.device, dtype: torch.dtype, *, bf16_upcast: bool | None = None, mkl_pack: bool | None = None
) -> WeightCache | None:
    """The matmul kernel of a cached forward on `device` in `dtype`, as its weight cache:
    `Fp32Weights` for a bf16 model with `bf16_upcast` (None: `upcast_bf16_default`),
    `MklPackedWeights` for an fp32 model where MKL's packed GEMM can run with `mkl_pack` (None:
    on wherever it can run, measured faster on the one CPU tried, an AVX-512 Xeon; see above), or
    None: torch's `F.linear`."""
    if dtype == torch.bfloat16 and (upcast_bf16_default(device) if bf16_upcast is None else bf16_upcast):
        return Fp32Weights()
    if mkl_pack is not False and mkl_pack_available(device, dtype):
        return MklPackedWeights()
    return None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None, kernel: WeightCache | None) -> Tensor:
    """`F.linear`, or the same product with the chosen kernel (fp32 upcast, MKL packed)."""
    if kernel is None:
        return F.linear(x, weight, bias)
    return kernel.linear(x, weight, bias)


def project(proj: nn.Module, x: Tensor, kernel: WeightCache | None) -> Tensor:
    """Apply a projection module (`nn.Linear`, or a LoRA-wrapped one) with the chosen kernel."""
    if kernel is None:
        return proj(x)
    if type(proj) is nn.Linear:
        return linear(x, proj.weight, proj.bias, kernel)
    # A LoraLinear (importing its type here would be a cycle): it takes the weights itself.
    return proj(x, kernel=kernel)
