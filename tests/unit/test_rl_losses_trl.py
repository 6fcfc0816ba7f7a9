"""Slipstream's losses against TRL 1.16's `GRPOTrainer._compute_loss`, value and gradient, where TRL has the rule.

TRL's loss code runs as it is: `_compute_loss` is called on a stand-in for the trainer that holds
only the attributes it reads, with `_get_per_token_logps_and_entropies` returning our log-probs
(so the gradient flows back to the same leaf tensor). Each test names the TRL rule it checks:

- GRPO with a KL penalty to the reference (`beta`, TRL's only estimator, k3), normalised as
  `loss_type="bnpo"` (sum over the batch's tokens / their count = our normalizer "tokens") and
  as `loss_type="dr_grpo"` (sum / (B · max_completion_length) = our "constant" with that constant),
  with an off-policy ratio (`old_per_token_logps` = our behaviour log-probs): clip and KL alike.
- CISPO (`loss_type="cispo"`, cap `epsilon_high` = our 1 + cispo_clip_high, divided by
  `num_items_in_batch`) with a KL penalty.
- Masked importance sampling (`vllm_importance_sampling_mode="token_mask"` with
  `vllm_importance_sampling_clip_min/max`) = our off_policy_mask "token" with mask_low/high. TRL
  builds that ratio inline in `_generate_and_score_completions`, which needs a generation loop, so
  `trl_token_mask_ratio` below repeats its three lines (grpo_trainer.py, "token_mask" branch) and
  `_compute_loss` applies it. TRL multiplies the policy term by r = π_old/π_sampling (π_old = the
  current weights at its first iteration), which equals our r = π_θ/π_behaviour, so grpo agrees
  while every kept token is inside the clip band (TRL clips against π_old only) and cispo always.

Not compared, because TRL 1.16 has no such rule: Kimi K2.5's loss, the k1/k2 estimators, and the
sequence mask (TRL's "sequence_mask" thresholds the *product* of the token ratios, exp(Σ log r);
ours, IcePop's, the geometric mean, exp(mean log r)). Those are hand-computed in
test_rl_kimi_masks.py and test_rl_losses.py.
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from slipstream.rl import LossConfig, compute_loss

pytestmark = pytest.mark.unit

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")

# Two completions of 4 positions, the second with one padding position.
LOGP = [[-1.0, -0.5, -2.0, -1.5], [-0.7, -1.2, -0.9, -3.0]]
BEHAVIOUR = [[-1.1, -0.45, -2.3, -1.5], [-0.6, -1.2, -0.6, 0.0]]  # ratios e^(logp − behaviour)
REF = [[-0.9, -0.8, -2.1, -1.0], [-0.7, -1.0, -1.4, 0.0]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0]]
ADV = [0.75, -0.5]


def trl_loss(
    loss_type: str,
    logp: torch.Tensor,
    *,
    beta: float,
    old: list[list[float]] | None,
    eps: tuple[float, float] = (0.2, 0.2),
    is_ratio: torch.Tensor | None = None,
    max_completion_length: int = 4,
) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """TRL 1.16's `_compute_loss` on a stand-in trainer; returns the loss and TRL's logged metrics."""
    mask = torch.tensor(MASK, dtype=torch.float32)
    metrics: dict[str, dict[str, list[float]]] = {"train": defaultdict(list)}
    identity = SimpleNamespace(
        gather=lambda x: x.reshape(-1), gather_for_metrics=lambda x: x, reduce=lambda x, reduction: x,
        num_processes=1, sync_gradients=True,
    )  # fmt: skip
    stub: Any = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp, torch.zeros_like(logp), None),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=eps[0], epsilon_high=eps[1],
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=metrics, accelerator=identity,
        max_completion_length=max_completion_length,
    )  # fmt: skip
    inputs: dict[str, Any] = {
        "prompt_ids": torch.zeros(2, 1, dtype=torch.long),
        "prompt_mask": torch.ones(2, 1, dtype=torch.long),
        "completion_ids": torch.zeros(2, 4, dtype=torch.long),
        "completion_mask": mask,
        "advantages": torch.tensor(ADV),
        "ref_per_token_logps": torch.tensor(REF),
        "num_items_in_batch": mask.sum(),
    }
    if old is not None:
        inputs["old_per_token_logps"] = torch.tensor(old)
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = grpo_trainer.GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, metrics["train"]


def ours(cfg: LossConfig, logp: torch.Tensor, behaviour: list[list[float]]) -> Any:
    adv = torch.tensor(ADV).unsqueeze(1).expand(2, 4)
    return compute_loss(
        cfg,
        logprobs=logp,
        behaviour_logprobs=torch.tensor(behaviour),
        advantages=adv,
        mask=torch.tensor(MASK),
        ref_logprobs=torch.tensor(REF),
    )


def both(cfg: LossConfig, trl_type: str, *, behaviour: list[list[float]], **trl_kw: Any) -> tuple[Any, ...]:
    a = torch.tensor(LOGP, requires_grad=True)
    b = torch.tensor(LOGP, requires_grad=True)
    out = ours(cfg, a, behaviour)
    out.loss.backward()
    theirs, metrics = trl_loss(trl_type, b, **trl_kw)
    theirs.backward()
    assert a.grad is not None and b.grad is not None
    return out, a.grad * torch.tensor(MASK), theirs, b.grad * torch.tensor(MASK), metrics


@pytest.mark.parametrize("trl_type", ["bnpo", "dr_grpo"])
def test_grpo_with_k3_kl_equals_trl(trl_type: str) -> None:
    """TRL rule: loss_type bnpo / dr_grpo, epsilon 0.2, beta 0.04 (k3), old_per_token_logps = behaviour."""
    normalizer = "tokens" if trl_type == "bnpo" else "constant"
    cfg = LossConfig(type="grpo", kl_coef=0.04, kl_estimator="k3", normalizer=normalizer, loss_constant=2 * 4)
    out, grad, theirs, tgrad, metrics = both(cfg, trl_type, behaviour=BEHAVIOUR, beta=0.04, old=BEHAVIOUR)
    assert float(out.loss.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6, abs=1e-8)
    torch.testing.assert_close(grad, tgrad, rtol=1e-6, atol=1e-8)
    assert out.metrics["kl"] == pytest.approx(metrics["kl"][0], rel=1e-6)
    assert out.metrics["clip_fraction"] == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    assert out.metrics["clip_fraction"] > 0  # the comparison covers clipped tokens


def test_cispo_with_k3_kl_equals_trl() -> None:
    """TRL rule: loss_type cispo, epsilon_high 1.25 (the cap), beta 0.1 (k3), num_items_in_batch normaliser."""
    cfg = LossConfig(type="cispo", cispo_clip_high=0.25, kl_coef=0.1, normalizer="tokens")
    out, grad, theirs, tgrad, _ = both(cfg, "cispo", behaviour=BEHAVIOUR, beta=0.1, old=BEHAVIOUR, eps=(0.2, 1.25))
    assert float(out.loss.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    torch.testing.assert_close(grad, tgrad, rtol=1e-6, atol=1e-8)
    assert out.metrics["clip_fraction"] > 0  # e^0.3 = 1.35 is over the 1.25 cap


def trl_token_mask_ratio(old: torch.Tensor, sampling: torch.Tensor, lo: float, hi: float) -> torch.Tensor:
    """TRL 1.16 `_generate_and_score_completions`, vllm_importance_sampling_mode "token_mask" (repeated here)."""
    mask = torch.tensor(MASK, dtype=torch.float32)
    per_token_logps_diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    ratio = torch.exp(per_token_logps_diff)
    return ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)


@pytest.mark.parametrize(("loss", "trl_type"), [("grpo", "bnpo"), ("cispo", "cispo")])
def test_token_mask_equals_trl_masked_importance_sampling(loss: str, trl_type: str) -> None:
    """TRL rule: vllm_importance_sampling_mode token_mask, clip_min 0.85, clip_max 1.15, beta 0.04 (k3)."""
    lo, hi = 0.85, 1.15
    cfg = LossConfig(
        type=loss, off_policy_mask="token", mask_low=lo, mask_high=hi, normalizer="tokens", kl_coef=0.04,
        cispo_clip_high=3.0,
    )  # fmt: skip
    is_ratio = trl_token_mask_ratio(torch.tensor(LOGP), torch.tensor(BEHAVIOUR), lo, hi)
    eps = (0.2, 0.2) if loss == "grpo" else (0.2, 4.0)
    out, grad, theirs, tgrad, _ = both(
        cfg, trl_type, behaviour=BEHAVIOUR, beta=0.04, old=LOGP, is_ratio=is_ratio, eps=eps
    )
    assert float(out.loss.detach()) == pytest.approx(float(theirs.detach()), rel=1e-6)
    torch.testing.assert_close(grad, tgrad, rtol=1e-6, atol=1e-8)
    masked = int(((is_ratio == 0) & (torch.tensor(MASK) == 1)).sum())
    assert masked == 2  # ratios e^0.3 and e^-0.3 leave [0.85, 1.15]; the comparison covers masking
    assert out.metrics["masked_share"] == pytest.approx(masked / 7)


def test_the_inputs_make_ratios_on_both_sides_of_one() -> None:
    ratios = [
        math.exp(a - b)
        for ra, rb, rm in zip(LOGP, BEHAVIOUR, MASK, strict=True)
        for a, b, m in zip(ra, rb, rm, strict=True)
        if m
    ]
    assert min(ratios) < 0.85 and max(ratios) > 1.15
