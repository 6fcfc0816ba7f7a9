"""The `[loss]` config section, importable without torch.

Service config classes embed `LossConfig`; keeping it apart from the tensor code means a
service's `--help` and `--print-config` never import torch. Loss types are validated against the
built-in names plus any registered through `slipstream.rl.losses.register_loss`.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Doc = msgspec.Meta

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[KLEstimator, ...] = ("k1", "k2", "k3")

BUILTIN_LOSS_TYPES = ("cispo", "grpo", "kimi")
OffPolicyMask = Literal["none", "token", "sequence"]
OFF_POLICY_MASKS: tuple[OffPolicyMask, ...] = ("none", "token", "sequence")
_EXTRA_LOSS_TYPES: set[str] = set()


def declare_loss_type(name: str) -> None:
    """Called by `register_loss` so configs accept a loss type added at run time."""
    _EXTRA_LOSS_TYPES.add(name)


def known_loss_types() -> tuple[str, ...]:
    return tuple(sorted(set(BUILTIN_LOSS_TYPES) | _EXTRA_LOSS_TYPES))


class LossConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The `[loss]` section: which policy loss, its clipping, KL and normalisation."""

    type: Annotated[
        str, Doc(description="Loss in the registry: 'grpo' (PPO-style clip), 'cispo' or 'kimi' (Kimi K2.5).")
    ] = "grpo"
    clip_low: Annotated[float, Doc(description="grpo: the ratio is clipped from below at 1 - clip_low.")] = 0.2
    clip_high: Annotated[float, Doc(description="grpo: the ratio is clipped from above at 1 + clip_high.")] = 0.2
    cispo_clip_high: Annotated[
        float,
        Doc(
            description="cispo: the detached weight is capped at 1 + cispo_clip_high. Default 3.0 = a cap of 4.0, "
            "Tinker's default threshold, which Context-1 likely used (techniques.md §1.3)."
        ),
    ] = 3.0
    cispo_clip_low: Annotated[
        float | None,
        Doc(description="cispo: weight floor 1 - cispo_clip_low; unset = no floor (MiniMax-M1 practice)."),
    ] = None
    tis_cap: Annotated[
        float | None,
        Doc(
            description="Truncation of the ratio π_θ/π_behaviour (>= 1): grpo's unclipped branch uses "
            "min(r, tis_cap) (dual clip: a negative-advantage token whose ratio blew up gets no gradient), "
            "cispo's weight is capped at min(1 + cispo_clip_high, tis_cap). Unset = off."
        ),
    ] = None
    kimi_alpha: Annotated[
        float, Doc(description="kimi: tokens whose log(π_θ/π_behaviour) is below this get no policy gradient.")
    ] = -0.5
    kimi_beta: Annotated[
        float, Doc(description="kimi: tokens whose log(π_θ/π_behaviour) is above this get no policy gradient.")
    ] = 0.5
    kimi_tau: Annotated[
        float, Doc(description="kimi: weight τ of the τ·(log π_θ/π_behaviour)² penalty on every trained token.")
    ] = 0.1
    off_policy_mask: Annotated[
        OffPolicyMask,
        Doc(
            description="Mask off-policy tokens out of the loss (IcePop-style, two-sided): 'token' masks a token "
            "whose ratio π_θ/π_behaviour leaves [mask_low, mask_high]; 'sequence' masks every token of a row "
            "whose geometric-mean ratio leaves it; 'none' = off."
        ),
    ] = "none"
    mask_low: Annotated[float, Doc(description="Lower ratio bound of off_policy_mask (in (0, 1]).")] = 0.5
    mask_high: Annotated[float, Doc(description="Upper ratio bound of off_policy_mask (>= 1).")] = 2.0
    kl_coef: Annotated[
        float,
        Doc(
            description="Weight of the KL penalty to the reference policy (the initial weights; with LoRA, the "
            "base model with the adapters off); 0 = off, and no reference forward pass is run."
        ),
    ] = 0.0
    kl_estimator: Annotated[
        KLEstimator, Doc(description="Per-token KL estimator: 'k1' (Composer 2), 'k2' or 'k3'.")
    ] = "k3"
    normalizer: Annotated[
        Literal["", "constant", "tokens"],
        Doc(
            description="'constant': sum of token terms / loss_constant (Dr. GRPO, no length normalisation); "
            "'tokens': sum / trained tokens in the batch; empty = the loss type's own ('tokens' for kimi, "
            "whose objective is a batch-token mean, 'constant' otherwise)."
        ),
    ] = ""
    loss_constant: Annotated[
        float,
        Doc(description="Divisor for normalizer='constant'; e.g. trajectories per step x max completion tokens."),
    ] = 1024.0

    def __post_init__(self) -> None:
        if not self.normalizer:
            self.normalizer = "tokens" if self.type == "kimi" else "constant"
        if self.type not in known_loss_types():  # unknown types fail at config time, listing the valid ones
            raise ValueError(f"unknown loss type {self.type!r}; valid types: {', '.join(known_loss_types())}")
        checks = [
            (0.0 <= self.clip_low <= 1.0, f"clip_low must be in [0, 1], got {self.clip_low}"),
            (self.clip_high >= 0.0, f"clip_high must be >= 0, got {self.clip_high}"),
            (self.cispo_clip_high >= 0.0, f"cispo_clip_high must be >= 0, got {self.cispo_clip_high}"),
            (
                self.cispo_clip_low is None or 0.0 <= self.cispo_clip_low <= 1.0,
                f"cispo_clip_low must be in [0, 1] or unset, got {self.cispo_clip_low}",
            ),
            (self.tis_cap is None or self.tis_cap >= 1.0, f"tis_cap must be >= 1 or unset, got {self.tis_cap}"),
            (self.kl_coef >= 0.0, f"kl_coef must be >= 0, got {self.kl_coef}"),
            (
                self.kl_estimator in KL_ESTIMATORS,
                f"kl_estimator must be one of {', '.join(KL_ESTIMATORS)}, got {self.kl_estimator!r}",
            ),
            (self.loss_constant > 0.0, f"loss_constant must be > 0, got {self.loss_constant}"),
            (
                self.kimi_alpha < 0.0 < self.kimi_beta,
                f"kimi_alpha must be < 0 < kimi_beta (a log-ratio range around 0), got [{self.kimi_alpha}, "
                f"{self.kimi_beta}]",
            ),
            (self.kimi_tau >= 0.0, f"kimi_tau must be >= 0, got {self.kimi_tau}"),
            (
                self.off_policy_mask in OFF_POLICY_MASKS,
                f"off_policy_mask must be one of {', '.join(OFF_POLICY_MASKS)}, got {self.off_policy_mask!r}",
            ),
            (0.0 < self.mask_low <= 1.0, f"mask_low must be in (0, 1], got {self.mask_low}"),
            (self.mask_high >= 1.0, f"mask_high must be >= 1, got {self.mask_high}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
