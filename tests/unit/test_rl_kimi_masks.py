"""Kimi K2.5's loss and the off-policy masks (token, sequence), on hand-computed values.

Conventions as in test_rl_losses.py: r = exp(logprob − behaviour_logprob), A the advantage; the
loss is minimised, so d loss / d logprob < 0 pushes a token's probability up. Every trained token
here has logprob −1 and a behaviour log-prob chosen to give the log-ratio written next to it.
"""

from __future__ import annotations

import math
import re

import msgspec
import pytest
import torch

from slipstream.rl import LossConfig, compute_loss
from slipstream.rl.losses import off_policy_keep

pytestmark = pytest.mark.unit


def run(
    cfg: LossConfig, log_ratios: list[list[float]], advantages: list[list[float]], mask: list[list[int]]
) -> tuple[float, list[list[float]], dict[str, float]]:
    """Loss, d loss / d logprobs (shape of the input), metrics; logprobs are −1 everywhere."""
    logprobs = torch.full((len(log_ratios), len(log_ratios[0])), -1.0, requires_grad=True)
    behaviour = -1.0 - torch.tensor(log_ratios)
    out = compute_loss(
        cfg,
        logprobs=logprobs,
        behaviour_logprobs=behaviour,
        advantages=torch.tensor(advantages),
        mask=torch.tensor(mask),
    )
    out.loss.backward()
    assert logprobs.grad is not None
    return float(out.loss.detach()), logprobs.grad.tolist(), out.metrics


# --- kimi ------------------------------------------------------------------------------------------


def test_kimi_config_defaults_to_the_batch_token_mean() -> None:
    assert LossConfig(type="kimi").normalizer == "tokens"
    assert LossConfig(type="grpo").normalizer == "constant"
    assert LossConfig(type="kimi", normalizer="constant").normalizer == "constant"  # an explicit choice stands


def test_kimi_loss_and_gradient_hand_computed() -> None:
    cfg = LossConfig(type="kimi", kimi_alpha=-0.5, kimi_beta=0.5, kimi_tau=0.1)
    # log r:  0.3 (in), 0.7 (above β), −0.7 (below α), −0.3 (in); the 5th position is padding.
    loss, grad, m = run(cfg, [[0.3, 0.7, -0.7, -0.3, 0.0]], [[1.0, 1.0, -1.0, -1.0, 5.0]], [[1, 1, 1, 1, 0]])
    e3, em3 = math.exp(0.3), math.exp(-0.3)
    # terms: −r·A inside [α, β] (0 outside) + τ·(log r)²; divided by the 4 trained tokens.
    expected = (-e3 + 0.1 * 0.09 + 0.1 * 0.49 + 0.1 * 0.49 + em3 + 0.1 * 0.09) / 4
    assert loss == pytest.approx(expected, rel=1e-6)
    # d/dlogp: (−A·r·1[in] + 2τ·log r) / 4
    assert grad[0] == pytest.approx([(-e3 + 0.06) / 4, 0.14 / 4, -0.14 / 4, (em3 - 0.06) / 4, 0.0], rel=1e-5, abs=1e-7)
    assert m["clip_fraction"] == pytest.approx(0.5)  # two of four tokens outside [α, β]
    assert m["tokens"] == 4


@pytest.mark.parametrize("advantage", [2.0, -2.0])
def test_kimi_tokens_outside_the_log_ratio_range_get_no_policy_gradient_whatever_the_sign(advantage: float) -> None:
    # τ = 0 leaves the policy term alone. PPO's clip (grpo) would still give the token whose ratio
    # moved against A's push a gradient; kimi's mask gives neither side any.
    cfg = LossConfig(type="kimi", kimi_alpha=-0.2, kimi_beta=0.2, kimi_tau=0.0)
    _, grad, _ = run(cfg, [[0.5, -0.5, 0.1]], [[advantage] * 3], [[1, 1, 1]])
    assert grad[0][:2] == [0.0, 0.0]
    assert grad[0][2] == pytest.approx(-advantage * math.exp(0.1) / 3, rel=1e-6)
    grpo = LossConfig(type="grpo", clip_low=0.2, clip_high=0.2, normalizer="tokens")
    _, g, _ = run(grpo, [[0.5, -0.5, 0.1]], [[advantage] * 3], [[1, 1, 1]])
    assert sum(1 for x in g[0][:2] if x != 0.0) == 1  # grpo keeps one of the two out-of-range tokens


def test_kimi_quadratic_term_pulls_the_ratio_back_on_every_token() -> None:
    # A = 0: only τ·(log r)² remains; its gradient 2τ·log r / N pushes log r towards 0 in range and out.
    cfg = LossConfig(type="kimi", kimi_alpha=-0.5, kimi_beta=0.5, kimi_tau=0.25)
    loss, grad, _ = run(cfg, [[0.4, -1.0]], [[0.0, 0.0]], [[1, 1]])
    assert loss == pytest.approx(0.25 * (0.16 + 1.0) / 2, rel=1e-6)
    assert grad[0] == pytest.approx([0.5 * 0.4 / 2, 0.5 * -1.0 / 2], rel=1e-5)


def test_kimi_bounds_are_checked_when_the_config_loads() -> None:
    with pytest.raises(ValueError, match=re.escape("kimi_alpha must be < 0 < kimi_beta")):
        LossConfig(type="kimi", kimi_alpha=0.1)
    with pytest.raises(ValueError, match="kimi_tau must be >= 0, got -1"):
        LossConfig(type="kimi", kimi_tau=-1.0)


# --- off-policy masks ----------------------------------------------------------------------------


def test_token_mask_drops_tokens_whose_ratio_leaves_the_band_on_both_sides() -> None:
    cfg = LossConfig(type="cispo", off_policy_mask="token", mask_low=0.5, mask_high=2.0, loss_constant=1.0)
    # r = 1.5, 1.1, 0.4 (below 0.5), 2.5 (above 2.0), with A of both signs.
    lrs = [[math.log(1.5), math.log(1.1), math.log(0.4), math.log(2.5)]]
    loss, grad, m = run(cfg, lrs, [[1.0, -1.0, 1.0, -1.0]], [[1, 1, 1, 1]])
    # cispo: term = −sg(r)·A·logp (r under the cap 4); logp = −1 -> term = r·A; masked tokens 0.
    assert loss == pytest.approx(1.5 - 1.1, rel=1e-6)
    assert grad[0] == pytest.approx([-1.5, 1.1, 0.0, 0.0], rel=1e-6)
    assert m["masked_share"] == pytest.approx(0.5)
    unmasked = run(LossConfig(type="cispo", loss_constant=1.0), lrs, [[1.0, -1.0, 1.0, -1.0]], [[1, 1, 1, 1]])
    assert unmasked[1][0] == pytest.approx([-1.5, 1.1, -0.4, 2.5], rel=1e-6)
    assert unmasked[2]["masked_share"] == 0.0


def test_sequence_mask_uses_each_rows_geometric_mean_ratio() -> None:
    cfg = LossConfig(type="cispo", off_policy_mask="sequence", mask_low=0.5, mask_high=2.0, loss_constant=1.0)
    # Row 0: r = 3.0, 0.9 -> geometric mean sqrt(2.7) = 1.64: kept whole (a token mask would drop the 3.0).
    # Row 1: r = 2.5, 1.8, padding -> sqrt(4.5) = 2.12 > 2: every token dropped (a token mask keeps the 1.8).
    lrs = [[math.log(3.0), math.log(0.9), 0.0], [math.log(2.5), math.log(1.8), 7.0]]
    adv = [[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]]
    mask = [[1, 1, 0], [1, 1, 0]]
    loss, grad, m = run(cfg, lrs, adv, mask)
    assert loss == pytest.approx(3.0 + 0.9, rel=1e-6)
    assert grad[0] + grad[1] == pytest.approx([-3.0, -0.9, 0.0, 0.0, 0.0, 0.0], rel=1e-6)
    assert m["masked_share"] == pytest.approx(0.5)
    token = msgspec.structs.replace(cfg, off_policy_mask="token")
    _, tgrad, tm = run(token, lrs, adv, mask)
    assert tgrad[0] + tgrad[1] == pytest.approx([0.0, -0.9, 0.0, 0.0, -1.8, 0.0], rel=1e-6)
    assert tm["masked_share"] == pytest.approx(0.5)


def test_mask_bounds_are_inclusive_and_a_flat_input_is_one_sequence() -> None:
    trained = torch.tensor([True, True, True, False])
    lr = torch.tensor([math.log(0.5), math.log(2.0), 0.0, 50.0])
    assert off_policy_keep("token", lr, trained, 0.5, 2.0).tolist()[:3] == [True, True, True]
    assert off_policy_keep("none", lr, trained, 0.5, 2.0).all()
    # One flat sequence: mean log r over the 3 trained tokens = 0 -> kept; the padding's 50 is ignored.
    assert off_policy_keep("sequence", lr, trained, 0.9, 1.1).all()


def test_masked_tokens_keep_the_kl_penalty_and_count_in_the_token_normaliser() -> None:
    cfg = LossConfig(
        type="grpo", off_policy_mask="token", mask_low=0.8, mask_high=1.25, normalizer="tokens", kl_coef=0.5,
        kl_estimator="k1",
    )  # fmt: skip
    logprobs = torch.tensor([-1.0, -1.0], requires_grad=True)
    out = compute_loss(
        cfg,
        logprobs=logprobs,
        behaviour_logprobs=torch.tensor([-1.0, -1.0 - math.log(3.0)]),  # r = 1, 3 (masked)
        advantages=torch.tensor([1.0, 1.0]),
        mask=torch.tensor([1, 1]),
        ref_logprobs=torch.tensor([-1.2, -0.7]),
    )
    out.loss.backward()
    # policy: −(1·1)/2 for the kept token; k1 = logp − ref: 0.2 and −0.3, times 0.5, over 2 tokens.
    assert float(out.loss.detach()) == pytest.approx(-0.5 + 0.5 * (0.2 - 0.3) / 2, rel=1e-6)
    assert logprobs.grad is not None
    assert logprobs.grad.tolist() == pytest.approx([-0.5 + 0.25, 0.25], rel=1e-6)
    assert out.metrics["masked_share"] == pytest.approx(0.5)
    assert out.metrics["kl"] == pytest.approx(-0.05, rel=1e-5)


def test_mask_config_is_checked_when_it_loads() -> None:
    with pytest.raises(ValueError, match=re.escape("mask_low must be in (0, 1], got 1.5")):
        LossConfig(mask_low=1.5)
    with pytest.raises(ValueError, match=re.escape("mask_high must be >= 1, got 0.9")):
        LossConfig(mask_high=0.9)
    with pytest.raises(msgspec.ValidationError, match="off_policy_mask"):
        msgspec.convert({"off_policy_mask": "tokens"}, LossConfig)


def test_behaviour_kl_is_the_k3_mismatch_over_trained_tokens() -> None:
    # KL(π_behaviour ‖ π_θ) per token, k3: (r − 1) − log r; padding ignored.
    _, _, m = run(LossConfig(), [[0.2, -0.1, 9.0]], [[0.0, 0.0, 0.0]], [[1, 1, 0]])
    k3 = [math.expm1(x) - x for x in (0.2, -0.1)]
    assert m["behaviour_kl"] == pytest.approx(sum(k3) / 2, rel=1e-5)
