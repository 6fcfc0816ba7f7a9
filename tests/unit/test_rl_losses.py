"""Policy losses (grpo, cispo), normalisation, masking, KL and the registry, on hand-computed values.

Conventions in the comments: r = exp(logprob − behaviour_logprob) is the importance ratio, A the
advantage, C the loss constant; the loss is minimised, so a positive advantage must give a
negative gradient on the token's log-prob.
"""

from __future__ import annotations

import math

import msgspec
import pytest
import torch

from slipstream.rl import LossConfig, compute_loss, get_loss, kl_per_token, register_loss
from slipstream.rl.losses import grpo_terms

pytestmark = pytest.mark.unit


def leaf(xs: list[float]) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32, requires_grad=True)


def run(
    cfg: LossConfig,
    logprobs: torch.Tensor,
    behaviour: list[float] | torch.Tensor,
    advantages: list[float] | torch.Tensor,
    mask: list[int] | torch.Tensor,
    **kw: object,
) -> tuple[float, list[float], dict[str, float]]:
    """Loss value, d loss / d logprobs, metrics."""
    out = compute_loss(
        cfg,
        logprobs=logprobs,
        behaviour_logprobs=torch.as_tensor(behaviour, dtype=torch.float32),
        advantages=torch.as_tensor(advantages, dtype=torch.float32),
        mask=torch.as_tensor(mask),
        **kw,  # type: ignore[arg-type]
    )
    out.loss.backward()
    assert logprobs.grad is not None
    return float(out.loss.detach()), logprobs.grad.reshape(-1).tolist(), out.metrics


# Four trained tokens, all with logprob −1, whose behaviour log-probs give the ratios below.
RATIOS = [1.5, 1.1, 0.5, 1.5]
ADVS = [1.0, 1.0, -1.0, -2.0]


def off_policy_tokens() -> tuple[torch.Tensor, list[float]]:
    logprobs = leaf([-1.0] * 4)
    behaviour = [-1.0 - math.log(r) for r in RATIOS]
    return logprobs, behaviour


# --- grpo ---------------------------------------------------------------------------------------


def test_grpo_at_ratio_one_is_minus_masked_advantage_sum_over_constant() -> None:
    cfg = LossConfig(type="grpo", loss_constant=4.0)
    logprobs = leaf([-1.0, -2.0, -0.5, -1.5, -0.3])
    behaviour = [-1.0, -2.0, -0.5, -1.5, -0.3]  # on-policy: r = 1 everywhere
    adv = [2.0, 2.0, 2.0, -1.0, -1.0]
    mask = [1, 1, 0, 1, 1]
    loss, grad, m = run(cfg, logprobs, behaviour, adv, mask)
    # loss = −(2 + 2 − 1 − 1) / 4 = −0.5 ; d/dlogp = −A·mask / C
    assert loss == pytest.approx(-0.5)
    assert grad == pytest.approx([-0.5, -0.5, 0.0, 0.25, 0.25])
    assert m["tokens"] == 4
    assert m["ratio_mean"] == pytest.approx(1.0)
    assert m["clip_fraction"] == 0.0
    assert m["behaviour_kl"] == pytest.approx(0.0, abs=1e-7)
    assert m["loss"] == pytest.approx(-0.5)
    assert "kl" not in m


def test_grpo_clipped_tokens_get_zero_gradient() -> None:
    cfg = LossConfig(type="grpo", clip_low=0.2, clip_high=0.2, loss_constant=1.0)
    logprobs, behaviour = off_policy_tokens()
    loss, grad, m = run(cfg, logprobs, behaviour, ADVS, [1, 1, 1, 1])
    # token  r    A   min(r·A, clip(r,0.8,1.2)·A)   term   grad
    # a     1.5  +1   min(1.5, 1.2) = 1.2 clipped   −1.2   0
    # b     1.1  +1   min(1.1, 1.1) = 1.1           −1.1   −r·A = −1.1
    # c     0.5  −1   min(−0.5, −0.8) = −0.8 clipped 0.8   0
    # d     1.5  −2   min(−3.0, −2.4) = −3.0         3.0   −r·A = 3.0 (pessimistic side, not clipped)
    assert loss == pytest.approx(-1.2 - 1.1 + 0.8 + 3.0, abs=1e-5)
    assert grad == pytest.approx([0.0, -1.1, 0.0, 3.0], abs=1e-5)
    assert m["clip_fraction"] == pytest.approx(0.5)
    assert m["ratio_mean"] == pytest.approx((1.5 + 1.1 + 0.5 + 1.5) / 4, abs=1e-5)
    assert m["ratio_min"] == pytest.approx(0.5, abs=1e-6)
    assert m["ratio_max"] == pytest.approx(1.5, abs=1e-6)


def test_cispo_keeps_gradient_on_clipped_tokens() -> None:
    cfg = LossConfig(type="cispo", cispo_clip_high=0.2, loss_constant=1.0)
    logprobs, behaviour = off_policy_tokens()
    loss, grad, m = run(cfg, logprobs, behaviour, ADVS, [1, 1, 1, 1])
    # w = sg(min(r, 1.2)) (no floor) = (1.2, 1.1, 0.5, 1.2); term = −w·A·logp with logp = −1
    # terms = (1.2, 1.1, −0.5, −2.4) ; grad = −w·A = (−1.2, −1.1, 0.5, 2.4): none is zero
    assert loss == pytest.approx(1.2 + 1.1 - 0.5 - 2.4, abs=1e-5)
    assert grad == pytest.approx([-1.2, -1.1, 0.5, 2.4], abs=1e-5)
    assert all(g != 0.0 for g in grad)
    assert m["clip_fraction"] == pytest.approx(0.5)  # a and d hit the cap


def test_cispo_default_cap_is_four_and_floor_optional() -> None:
    cfg = LossConfig(type="cispo", loss_constant=1.0)
    assert cfg.cispo_clip_high == 3.0 and cfg.cispo_clip_low is None
    logprobs = leaf([-1.0, -1.0])
    behaviour = [-1.0 - math.log(5.0), -1.0 - math.log(0.5)]  # r = 5, 0.5
    _, grad, _ = run(cfg, logprobs, behaviour, [1.0, 1.0], [1, 1])
    assert grad == pytest.approx([-4.0, -0.5], abs=1e-5)  # w = min(5, 4), 0.5 (no floor)

    floored = LossConfig(type="cispo", cispo_clip_low=0.2, loss_constant=1.0)
    logprobs = leaf([-1.0, -1.0])
    _, grad, _ = run(floored, logprobs, behaviour, [1.0, 1.0], [1, 1])
    assert grad == pytest.approx([-4.0, -0.8], abs=1e-5)  # 0.5 raised to the floor 1 − 0.2


def test_cispo_at_ratio_one_is_reinforce() -> None:
    cfg = LossConfig(type="cispo", loss_constant=2.0)
    logprobs = leaf([-0.5, -2.0])
    loss, grad, _ = run(cfg, logprobs, [-0.5, -2.0], [3.0, -1.0], [1, 1])
    # REINFORCE: loss = −Σ A·logp / C = −(3·−0.5 + −1·−2) / 2 = −0.25 ; grad = −A / C
    assert loss == pytest.approx(-0.25)
    assert grad == pytest.approx([-1.5, 0.5])


def test_stale_behaviour_logprobs_give_ratio_above_one() -> None:
    # Sampled by an older policy: behaviour −1.2, current −1.0 -> r = e^0.2 = 1.2214028
    cfg = LossConfig(type="grpo", clip_high=0.3, loss_constant=1.0)
    logprobs = leaf([-1.0])
    loss, grad, m = run(cfg, logprobs, [-1.2], [1.0], [1])
    assert m["ratio_mean"] == pytest.approx(1.2214028, abs=1e-6)
    assert loss == pytest.approx(-1.2214028, abs=1e-6)  # inside [0.8, 1.3]: −r·A
    assert grad == pytest.approx([-1.2214028], abs=1e-6)
    # KL(behaviour ‖ current) by k3: (r − 1) − log r = 0.2214028 − 0.2 = 0.0214028
    assert m["behaviour_kl"] == pytest.approx(0.0214028, abs=1e-6)
    # Same token with the default clip_high 0.2: r > 1.2 -> clipped, loss −1.2, no gradient.
    logprobs = leaf([-1.0])
    loss, grad, m = run(LossConfig(loss_constant=1.0), logprobs, [-1.2], [1.0], [1])
    assert loss == pytest.approx(-1.2, abs=1e-6)
    assert grad == [0.0]
    assert m["clip_fraction"] == 1.0


def test_tis_cap_bounds_an_exploded_negative_advantage_token() -> None:
    behaviour = [-1.0 - math.log(5.0)]  # r = 5, A = −1
    logprobs = leaf([-1.0])
    loss, grad, _ = run(LossConfig(loss_constant=1.0), logprobs, behaviour, [-1.0], [1])
    assert loss == pytest.approx(5.0, abs=1e-5)  # −min(−5, −1.2) = 5, gradient −r·A = 5
    assert grad == pytest.approx([5.0], abs=1e-5)
    logprobs = leaf([-1.0])
    loss, grad, m = run(LossConfig(tis_cap=3.0, loss_constant=1.0), logprobs, behaviour, [-1.0], [1])
    assert loss == pytest.approx(3.0, abs=1e-5)  # −min(min(5, 3)·−1, −1.2) = 3, constant
    assert grad == [0.0]
    assert m["clip_fraction"] == 1.0
    logprobs = leaf([-1.0])
    _, grad, _ = run(LossConfig(type="cispo", tis_cap=2.0, loss_constant=1.0), logprobs, behaviour, [-1.0], [1])
    assert grad == pytest.approx([2.0], abs=1e-5)  # w = min(5, 4, 2) = 2 ; grad = −w·A


# --- masking and normalisation ------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["grpo", "cispo"])
def test_masked_tokens_contribute_neither_loss_nor_gradient(loss_type: str) -> None:
    cfg = LossConfig(type=loss_type, loss_constant=1.0)
    clean = leaf([-1.0, -0.5])
    base, base_grad, _ = run(cfg, clean, [-1.1, -0.4], [1.0, -1.0], [1, 1])
    # Same two tokens plus a masked one whose values are garbage (−inf log-prob, NaN behaviour,
    # huge advantage): nothing of it may reach the loss or the gradient.
    dirty = leaf([-1.0, float("-inf"), -0.5])
    loss, grad, m = run(cfg, dirty, [-1.1, float("nan"), -0.4], [1.0, 1e6, -1.0], [1, 0, 1])
    assert loss == pytest.approx(base)
    assert grad == pytest.approx([base_grad[0], 0.0, base_grad[1]])
    assert m["tokens"] == 2


def test_constant_normaliser_weights_sequences_by_length() -> None:
    # Padded [2, 4]: sequence 0 has 4 trained tokens, sequence 1 has 2 (then padding).
    # Identical per-token terms (r = 1, A = 1, term −1): with a constant divisor every token gets
    # the same gradient −1/C, so the long sequence contributes twice the short one. Per-sequence
    # length normalisation would instead give the short sequence's tokens twice the gradient.
    cfg = LossConfig(loss_constant=8.0)
    logprobs = torch.full((2, 4), -1.0, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    out = compute_loss(
        cfg, logprobs=logprobs, behaviour_logprobs=torch.full((2, 4), -1.0), advantages=torch.ones(2, 4), mask=mask
    )
    out.loss.backward()
    assert logprobs.grad is not None
    assert float(out.loss.detach()) == pytest.approx(-6 / 8)
    assert logprobs.grad.tolist() == [[-0.125] * 4, [-0.125, -0.125, 0.0, 0.0]]
    assert float(logprobs.grad[0].sum()) == pytest.approx(2 * float(logprobs.grad[1].sum()))


def test_token_normaliser_divides_by_trained_tokens_and_accumulates() -> None:
    cfg = LossConfig(normalizer="tokens")
    logprobs = leaf([-1.0, -1.0, -1.0, -1.0, -1.0, -1.0])
    adv = [1.0, 2.0, 3.0, -1.0, 4.0, 0.0]
    mask = [1, 1, 1, 0, 1, 1]
    loss, grad, _ = run(cfg, logprobs, [-1.0] * 6, adv, mask)
    # 5 trained tokens: loss = −(1 + 2 + 3 + 4 + 0) / 5 = −2
    assert loss == pytest.approx(-2.0)
    assert grad == pytest.approx([-0.2, -0.4, -0.6, 0.0, -0.8, 0.0])
    # Two micro-batches dividing by the whole step's count add up to the full-batch loss.
    halves = [
        run(cfg, leaf([-1.0] * 3), [-1.0] * 3, adv[:3], mask[:3], total_tokens=5)[0],
        run(cfg, leaf([-1.0] * 3), [-1.0] * 3, adv[3:], mask[3:], total_tokens=5)[0],
    ]
    assert sum(halves) == pytest.approx(loss)


def test_all_masked_batch_has_zero_loss() -> None:
    loss, grad, m = run(LossConfig(normalizer="tokens"), leaf([-1.0, -2.0]), [-1.0, -1.0], [1.0, 1.0], [0, 0])
    assert loss == 0.0
    assert grad == [0.0, 0.0]
    assert m["tokens"] == 0 and m["ratio_mean"] == 1.0


def test_bf16_logprobs_are_computed_in_float32() -> None:
    # 300 tokens: bf16 cannot represent 299 or 300 exactly, float32 can.
    logprobs = torch.full((300,), -1.0, dtype=torch.bfloat16, requires_grad=True)
    out = compute_loss(
        LossConfig(normalizer="tokens"),
        logprobs=logprobs,
        behaviour_logprobs=torch.full((300,), -1.0),
        advantages=torch.full((300,), 3.0),
        mask=torch.ones(300),
    )
    out.loss.backward()
    assert logprobs.grad is not None and logprobs.grad.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32
    assert out.metrics["tokens"] == 300
    assert float(out.loss.detach()) == pytest.approx(-3.0)  # −Σ A / 300


# --- KL -----------------------------------------------------------------------------------------


def test_kl_is_off_by_default() -> None:
    assert LossConfig().kl_coef == 0.0
    args = ([-1.0, -1.0], [1.0, -1.0], [1, 1])
    base, _, m_base = run(LossConfig(loss_constant=1.0), leaf([-1.0, -0.5]), *args)
    ref = torch.tensor([-3.0, -0.1])
    loss, _, m = run(LossConfig(loss_constant=1.0), leaf([-1.0, -0.5]), *args, ref_logprobs=ref)
    assert "kl" not in m_base
    assert loss == pytest.approx(base)  # reported, not penalised
    assert "kl_loss" not in m
    # k3 per token: log r = ref − logp = (−2, 0.4): (e^−2 − 1 + 2, e^0.4 − 1 − 0.4) = (1.135335, 0.091825)
    assert m["kl"] == pytest.approx((1.135335 + 0.091825) / 2, abs=1e-5)


def test_kl_penalty_k3_hand_computed() -> None:
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k3", loss_constant=1.0)
    logprobs = leaf([-1.0, -1.0])
    # on-policy and A = 0: the policy term is 0, only the KL remains.
    # token 1: log r = −2 − (−1) = −1 -> k3 = e^−1 − 1 + 1 = 0.3678794 ; token 2: ref = logp -> 0
    loss, grad, m = run(cfg, logprobs, [-1.0, -1.0], [0.0, 0.0], [1, 1], ref_logprobs=torch.tensor([-2.0, -1.0]))
    assert loss == pytest.approx(0.1 * 0.3678794, abs=1e-6)
    assert m["kl"] == pytest.approx(0.3678794 / 2, abs=1e-6)
    assert m["kl_loss"] == pytest.approx(0.03678794, abs=1e-6)
    # d k3 / d logp = 1 − e^(ref − logp): token 1: 1 − e^−1 = 0.6321206, times kl_coef
    assert grad == pytest.approx([0.06321206, 0.0], abs=1e-6)


def test_kl_estimators_hand_computed() -> None:
    logp, ref = torch.tensor([-1.0, -1.0]), torch.tensor([-2.0, -0.5])  # log r = (−1, 0.5)
    assert kl_per_token(logp, ref, "k1").tolist() == pytest.approx([1.0, -0.5])
    assert kl_per_token(logp, ref, "k2").tolist() == pytest.approx([0.5, 0.125])
    assert kl_per_token(logp, ref, "k3").tolist() == pytest.approx([math.exp(-1), math.exp(0.5) - 1.5])


def test_kl_coef_without_reference_is_an_error() -> None:
    with pytest.raises(ValueError, match="ref_logprobs"):
        run(LossConfig(kl_coef=0.1), leaf([-1.0]), [-1.0], [1.0], [1])


# --- registry and config ------------------------------------------------------------------------


def test_unknown_loss_type_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown loss type 'ppo2'; valid types: cispo, grpo"):
        LossConfig(type="ppo2")
    with pytest.raises(msgspec.ValidationError, match="valid types: cispo, grpo"):
        msgspec.convert({"type": "ppo2"}, LossConfig)
    with pytest.raises(ValueError, match="valid types: cispo, grpo"):
        get_loss("reinforce")


def test_registry_maps_type_to_function_and_refuses_duplicates() -> None:
    assert get_loss("grpo") is grpo_terms
    with pytest.raises(ValueError, match="already registered"):
        register_loss("grpo")(grpo_terms)


def test_config_decodes_from_toml_like_dict_and_rejects_bad_values() -> None:
    cfg = msgspec.convert({"type": "cispo", "cispo_clip_high": 4.0, "kl_estimator": "k1"}, LossConfig)
    assert (cfg.type, cfg.cispo_clip_high, cfg.kl_estimator, cfg.normalizer) == ("cispo", 4.0, "k1", "constant")
    with pytest.raises(msgspec.ValidationError, match="unknown field"):
        msgspec.convert({"clip": 0.2}, LossConfig)
    for bad, field in [
        ({"clip_low": 1.5}, "clip_low"),
        ({"tis_cap": 0.5}, "tis_cap"),
        ({"kl_coef": -1.0}, "kl_coef"),
        ({"loss_constant": 0.0}, "loss_constant"),
    ]:
        with pytest.raises(ValueError, match=field):
            LossConfig(**bad)  # type: ignore[arg-type]


def test_shape_mismatch_names_the_input() -> None:
    with pytest.raises(ValueError, match="advantages shape"):
        compute_loss(
            LossConfig(),
            logprobs=torch.zeros(2, 3),
            behaviour_logprobs=torch.zeros(2, 3),
            advantages=torch.zeros(2),
            mask=torch.ones(2, 3),
        )
