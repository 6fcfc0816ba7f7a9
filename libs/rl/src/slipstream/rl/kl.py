"""Per-token KL estimators between the current policy and a frozen reference.

Tokens are sampled from (approximately) the current policy π_θ, so with r = π_ref / π_θ and
log r = ref_logprob − logprob, each estimator's expectation is KL(π_θ ‖ π_ref) (Schulman's
"Approximating KL divergence"):

    k1 = −log r                 unbiased, high variance, can be negative per token
    k2 = ½ (log r)²             biased, low variance, always >= 0
    k3 = (r − 1) − log r        unbiased, low variance near r = 1, always >= 0

k3 is the common GRPO default. Composer 2 reports using k1, because k3's variance explodes when
the two policies drift apart (techniques.md §1.1); both are selectable by config.
"""

from __future__ import annotations

import torch
from torch import Tensor

from slipstream.rl.config import KL_ESTIMATORS, KLEstimator

LOG_RATIO_LIMIT = 20.0
"""Log-ratios are clamped to ±LOG_RATIO_LIMIT before exp(): e^20 ≈ 5e8 is already far past any clip,
and an unclamped exp() of a corrupted log-prob overflows to inf, whose backward is 0·inf = NaN."""


def kl_per_token(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token KL(π_θ ‖ π_ref) estimate; differentiable w.r.t. `logprobs`, `ref_logprobs` is detached."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"ref_logprobs shape {tuple(ref_logprobs.shape)} does not match logprobs shape {tuple(logprobs.shape)}"
        )
    log_r = (ref_logprobs.detach() - logprobs).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; valid estimators: {', '.join(KL_ESTIMATORS)}")
