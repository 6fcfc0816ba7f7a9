"""Policy-gradient losses for asynchronous RL, one registry keyed by the config `type`.

Inputs are per-token tensors of one shape (flat [N] or padded [B, T-1]):

    logprobs            log π_θ(token) under the current weights, requires grad
    behaviour_logprobs  log π_behaviour(token), recorded by the rollout worker at sampling time
    advantages          the sequence's advantage broadcast to each of its tokens
    mask                nonzero = trained (policy tokens); zero = prompt, observations, padding
    ref_logprobs        optional, log π_ref(token) of a frozen reference, for the KL term

Behaviour-policy correction. Rollouts are off-policy: a trajectory may have been sampled by a
policy several versions old, even by two versions at once after a mid-rollout weight refresh.
There is no separate "old policy" forward pass here: the importance ratio
r = π_θ / π_behaviour = exp(logprobs − behaviour_logprobs) is taken against the log-probs recorded
at sampling time, per token, so each token is corrected for exactly the version that produced it.
That ratio, clipped, IS the off-policy correction; staleness beyond `max_staleness` is dropped
before it gets here (admission.py). `tis_cap` additionally truncates the ratio for the tokens
whose behaviour policy is far from the current one.

Aggregation (Dr. GRPO / Composer 2): per-token terms are summed over every trained token of the
batch and divided by a constant, never by each sequence's own length, so a sequence's weight grows
with its trained-token count. `normalizer = "tokens"` divides by the trained-token count instead
(Kimi K2.5's token mean over the batch); there is no per-sequence normalisation either way.

Loss types (each returns per-token terms to be minimised):

    grpo   term = −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)
           PPO-style: a token outside the trust region in the direction A pushes gets zero gradient.
    cispo  term = −sg(clip(r, 1 − cispo_clip_low, 1 + cispo_clip_high))·A·log π_θ
           CISPO (MiniMax-M1, Context-1): the clipped weight is detached, so every token keeps a
           gradient A·w·∇log π_θ; clipping only bounds its size. With r = 1 it is REINFORCE.
    kimi   term = −1[α ≤ log r ≤ β]·r·A + τ·(log r)²
           Kimi K2.5 (techniques.md §1.2): a token whose log-ratio leaves [kimi_alpha, kimi_beta]
           gets no policy gradient whatever the sign of A (a mask, not PPO's one-sided clip); the
           quadratic penalty applies to every trained token and pulls the ratio back to 1. Its
           normaliser is the batch's trained-token count (normalizer '' resolves to 'tokens').

Off-policy masking (off_policy_mask, off by default; IcePop-style, two-sided, any loss type): a
masked token's policy term (kimi's τ term included) is zeroed, so it gets no policy gradient; the
KL penalty to the reference still applies to it, and it still counts in the 'tokens' normaliser,
as with TRL 1.16's masked importance sampling (vllm_importance_sampling_mode token_mask). The
mask is taken on the same ratio r as the loss, so with substeps it also catches the drift of
the substeps before.

    token     mask a token whose ratio r leaves [mask_low, mask_high]
    sequence  mask every token of a row whose geometric-mean ratio exp(mean log r over its
              trained tokens) leaves [mask_low, mask_high]; rows are the first dimension of a
              [B, T] batch (one training sample each); a flat [N] input is one row

Optional KL penalty (kl_coef > 0, off by default): kl_coef · Σ mask·k(logprobs, ref_logprobs) / D,
with the same divisor D as the policy term and k one of the estimators in kl.py.

Figures (`LossOutput.metrics`, token means over trained tokens unless said): ratio_mean/min/max,
clip_fraction (grpo: clipped; cispo: weight capped; kimi: outside [α, β]), behaviour_kl (the
train–inference mismatch: k3 estimate of KL(π_behaviour ‖ π_θ) over the trained tokens),
masked_share (share of trained tokens the off-policy mask removed; 0 with the mask off), kl (to
the reference, when ref_logprobs are given) and kl_loss, policy_loss, loss, tokens (a count).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import msgspec
import torch
from torch import Tensor

from slipstream.rl.config import LossConfig, OffPolicyMask, declare_loss_type
from slipstream.rl.kl import LOG_RATIO_LIMIT, kl_per_token

Doc = msgspec.Meta


class PolicyTerms(NamedTuple):
    """What one loss type computes per token (before masking and normalisation)."""

    terms: Tensor
    """Per-token loss terms, to be minimised."""
    clipped: Tensor
    """Bool per token: its ratio or weight was clipped (grpo: its gradient is zero)."""


PolicyLoss = Callable[[LossConfig, Tensor, Tensor, Tensor], PolicyTerms]
"""(config, logprobs, ratio, advantages) -> PolicyTerms; inputs already zeroed outside the mask."""

_LOSSES: dict[str, PolicyLoss] = {}


def register_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator adding a loss type to the registry under `name` (the config `type`)."""

    def add(fn: PolicyLoss) -> PolicyLoss:
        if name in _LOSSES:
            raise ValueError(f"loss type {name!r} is already registered")
        _LOSSES[name] = fn
        declare_loss_type(name)
        return fn

    return add


def loss_types() -> tuple[str, ...]:
    """Registered loss types, sorted."""
    return tuple(sorted(_LOSSES))


def get_loss(name: str) -> PolicyLoss:
    """The loss registered as `name`, or a ValueError listing the valid types."""
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown loss type {name!r}; valid types: {', '.join(loss_types())}") from None


@register_loss("grpo")
def grpo_terms(config: LossConfig, logprobs: Tensor, ratio: Tensor, advantages: Tensor) -> PolicyTerms:
    """term = −min(r'·A, clip(r, 1 − clip_low, 1 + clip_high)·A), r' = min(r, tis_cap) when set."""
    del logprobs  # the gradient flows through the ratio
    low, high = 1.0 - config.clip_low, 1.0 + config.clip_high
    unclipped = ratio if config.tis_cap is None else ratio.clamp(max=config.tis_cap)
    objective = torch.minimum(unclipped * advantages, ratio.clamp(low, high) * advantages)
    r = ratio.detach()
    clipped = ((advantages > 0) & (r > high)) | ((advantages < 0) & (r < low))
    if config.tis_cap is not None:
        clipped |= (advantages < 0) & (r > config.tis_cap)
    return PolicyTerms(terms=-objective, clipped=clipped)


@register_loss("cispo")
def cispo_terms(config: LossConfig, logprobs: Tensor, ratio: Tensor, advantages: Tensor) -> PolicyTerms:
    """term = −sg(clip(r, 1 − cispo_clip_low, min(1 + cispo_clip_high, tis_cap)))·A·log π_θ."""
    low = 0.0 if config.cispo_clip_low is None else 1.0 - config.cispo_clip_low
    high = 1.0 + config.cispo_clip_high
    if config.tis_cap is not None:
        high = min(high, config.tis_cap)
    r = ratio.detach()
    weight = r.clamp(low, high)
    return PolicyTerms(terms=-(weight * advantages) * logprobs, clipped=(r < low) | (r > high))


@register_loss("kimi")
def kimi_terms(config: LossConfig, logprobs: Tensor, ratio: Tensor, advantages: Tensor) -> PolicyTerms:
    """term = −1[kimi_alpha ≤ log r ≤ kimi_beta]·r·A + kimi_tau·(log r)² (Kimi K2.5's objective, minimised)."""
    del logprobs  # the gradient flows through the ratio
    log_ratio = torch.log(ratio)
    lr = log_ratio.detach()
    outside = (lr < config.kimi_alpha) | (lr > config.kimi_beta)
    policy = torch.where(outside, 0.0, ratio * advantages)
    return PolicyTerms(terms=-policy + config.kimi_tau * log_ratio.square(), clipped=outside)


def off_policy_keep(kind: OffPolicyMask, log_ratio: Tensor, trained: Tensor, low: float, high: float) -> Tensor:
    """Bool per token: kept by the off-policy mask `kind` (everything for 'none'); see the module docstring.

    `log_ratio` is log(π_θ/π_behaviour) (detached here), `trained` the bool mask of trained tokens.
    """
    lo, hi = math.log(low), math.log(high)
    if kind == "none":
        return torch.ones_like(trained)
    lr = torch.where(trained, log_ratio.detach(), 0.0)
    if kind == "token":
        return (lr >= lo) & (lr <= hi)
    if kind == "sequence":
        rows = lr.reshape(1, -1) if lr.dim() == 1 else lr
        counts = trained.reshape(rows.shape).sum(dim=-1, keepdim=True).clamp(min=1)
        mean = rows.sum(dim=-1, keepdim=True) / counts  # log of the geometric-mean ratio per row
        keep = (mean >= lo) & (mean <= hi)
        return keep.expand_as(rows).reshape(lr.shape)
    raise ValueError(f"unknown off_policy_mask {kind!r}; valid: none, token, sequence")


@dataclass(frozen=True)
class LossOutput:
    """The scalar to backpropagate and the figures to log (plain floats, already synced)."""

    loss: Tensor
    metrics: dict[str, float]


def _check_inputs(named: dict[str, Tensor | None]) -> None:
    logprobs = named["logprobs"]
    assert logprobs is not None
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating tensor, got {logprobs.dtype}")
    if logprobs.numel() == 0:
        raise ValueError("logprobs is empty; a batch needs at least one token position")
    for name, t in named.items():
        if t is not None and t.shape != logprobs.shape:
            raise ValueError(f"{name} shape {tuple(t.shape)} does not match logprobs shape {tuple(logprobs.shape)}")


def compute_loss(
    config: LossConfig,
    *,
    logprobs: Tensor,
    behaviour_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref_logprobs: Tensor | None = None,
    total_tokens: int | None = None,
) -> LossOutput:
    """The configured loss over one batch (see the module docstring for the formulas).

    `total_tokens` overrides the trained-token count used by normalizer='tokens' (ignored by
    'constant'), so that with gradient accumulation each micro-batch divides by the whole step's
    count and the micro-batch losses add up to the full-batch loss. The KL metric is reported
    whenever `ref_logprobs` is given; the KL penalty enters the loss only when kl_coef > 0.
    """
    loss_fn = get_loss(config.type)
    _check_inputs(
        {
            "logprobs": logprobs,
            "behaviour_logprobs": behaviour_logprobs,
            "advantages": advantages,
            "mask": mask,
            "ref_logprobs": ref_logprobs,
        }
    )
    if total_tokens is not None and total_tokens < 0:
        raise ValueError(f"total_tokens must be >= 0, got {total_tokens}")
    if config.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef is {config.kl_coef} but no ref_logprobs were given")

    trained = mask if mask.dtype == torch.bool else mask != 0
    # At least float32: bf16 cannot even count tokens past 256 exactly.
    dtype = torch.promote_types(logprobs.dtype, torch.float32)
    # Masked positions are zeroed before any arithmetic: padding log-probs may be -inf or garbage,
    # and a NaN there would leak into the gradient even when multiplied by a zero mask.
    logp = torch.where(trained, logprobs.to(dtype), 0.0)
    behaviour = torch.where(trained, behaviour_logprobs.detach().to(logp.dtype), 0.0)
    adv = torch.where(trained, advantages.detach().to(logp.dtype), 0.0)
    log_ratio = (logp - behaviour).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = torch.exp(log_ratio)

    policy = loss_fn(config, logp, ratio, adv)
    terms = torch.where(trained, policy.terms, 0.0)
    masking = config.off_policy_mask != "none"
    if masking:
        kept = off_policy_keep(config.off_policy_mask, log_ratio, trained, config.mask_low, config.mask_high)
        terms = torch.where(kept, terms, 0.0)
    n_tokens = trained.sum()
    divisor: Tensor | float
    if config.normalizer == "constant":
        divisor = config.loss_constant
    elif total_tokens is not None:
        divisor = float(max(total_tokens, 1))
    else:
        divisor = n_tokens.clamp(min=1).to(dtype)
    policy_loss = terms.sum() / divisor
    loss = policy_loss

    denom = n_tokens.clamp(min=1).to(dtype)
    r = ratio.detach()
    figures: dict[str, Tensor] = {
        "policy_loss": policy_loss.detach(),
        "tokens": n_tokens.to(torch.float64),
        "ratio_mean": torch.where(trained, r, 0.0).sum() / denom,
        "ratio_min": torch.where(trained, r, torch.inf).amin(),
        "ratio_max": torch.where(trained, r, -torch.inf).amax(),
        "clip_fraction": (policy.clipped & trained).sum().to(dtype) / denom,
        # k3 estimate of KL(π_behaviour ‖ π_θ) over tokens sampled from π_behaviour: how far
        # off-policy the batch is; 0 when every token came from the current weights.
        "behaviour_kl": torch.where(trained, torch.expm1(log_ratio.detach()) - log_ratio.detach(), 0.0).sum() / denom,
        "masked_share": (trained & ~kept).sum().to(dtype) / denom if masking else torch.zeros((), dtype=dtype),
    }
    if ref_logprobs is not None:
        ref = torch.where(trained, ref_logprobs.detach().to(dtype), 0.0)
        kl_terms = torch.where(trained, kl_per_token(logp, ref, config.kl_estimator), 0.0)
        figures["kl"] = kl_terms.detach().sum() / denom
        if config.kl_coef > 0:
            kl_loss = config.kl_coef * kl_terms.sum() / divisor
            figures["kl_loss"] = kl_loss.detach()
            loss = loss + kl_loss
    figures["loss"] = loss.detach()

    values = torch.stack([v.to(torch.float64) for v in figures.values()]).tolist()  # one device sync
    metrics = dict(zip(figures, values, strict=True))
    if metrics["tokens"] == 0:
        # min/max over no tokens are ±inf; report neutral figures for an empty batch.
        metrics.update(ratio_mean=1.0, ratio_min=1.0, ratio_max=1.0)
    return LossOutput(loss=loss, metrics=metrics)
