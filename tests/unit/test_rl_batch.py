"""Batch packing (next-token alignment, padding, validation) and token log-probs, on hand-built inputs."""

from __future__ import annotations

import math

import pytest
import torch

from slipstream.rl import LossConfig, TrainItem, compute_loss, pack_batch, token_logprobs

pytestmark = pytest.mark.unit


def close(actual: torch.Tensor, expected: list[list[float]], atol: float = 1e-6, rtol: float = 0.0) -> bool:
    want = torch.tensor(expected, dtype=torch.float64)
    return actual.shape == want.shape and torch.allclose(actual.double(), want, atol=atol, rtol=rtol)


# Prompt [10, 11, 12] + completion [20, 21], both completion tokens trained.
SHORT = TrainItem(
    token_ids=[10, 11, 12, 20, 21], prompt_len=3, behaviour_logprobs=[-0.1, -0.2], loss_mask=[1, 1], advantage=0.5
)
# Prompt [30, 31] + completion [40, 41, 42, 43] where 41 and 42 are a tool observation (mask 0).
LONG = TrainItem(
    token_ids=[30, 31, 40, 41, 42, 43],
    prompt_len=2,
    behaviour_logprobs=[-0.3, -0.4, -0.5, -0.6],
    loss_mask=[1, 0, 0, 1],
    advantage=-1.0,
)


def test_pack_batch_aligns_completion_tokens_with_their_predicting_position() -> None:
    b = pack_batch([SHORT, LONG], pad_id=7)
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21, 7], [30, 31, 40, 41, 42, 43]]
    assert b.attention_mask.tolist() == [[True] * 5 + [False], [True] * 6]
    assert b.lengths.tolist() == [5, 6]
    # targets[:, j] = input_ids[:, j + 1]
    assert b.targets.tolist() == [[11, 12, 20, 21, 7], [31, 40, 41, 42, 43]]
    # The first completion token is predicted from the last prompt position (prompt_len − 1).
    assert b.input_ids[0, SHORT.prompt_len - 1] == 12 and b.targets[0, SHORT.prompt_len - 1] == 20
    assert b.input_ids[1, LONG.prompt_len - 1] == 31 and b.targets[1, LONG.prompt_len - 1] == 40
    # Trained positions: SHORT predicts 20, 21 at 2, 3; LONG predicts 40 at 1 and 43 at 4.
    assert b.mask.tolist() == [[False, False, True, True, False], [False, True, False, False, True]]
    assert close(b.behaviour_logprobs, [[0, 0, -0.1, -0.2, 0], [0, -0.3, 0, 0, -0.6]])
    # The advantage covers every completion position (the mask decides what is trained).
    assert b.advantages.tolist() == [[0, 0, 0.5, 0.5, 0], [0, -1, -1, -1, -1]]
    assert b.n_tokens == 4
    assert b.input_ids.dtype == torch.int64 and b.behaviour_logprobs.dtype == torch.float32


def test_packed_batch_feeds_the_loss_end_to_end() -> None:
    b = pack_batch([SHORT, LONG])
    # A "model" that reproduces the behaviour log-probs exactly (r = 1): grpo loss = −Σ A·mask / C
    # = −(0.5 + 0.5 − 1 − 1) / 2 = 0.5
    logprobs = b.behaviour_logprobs.clone().requires_grad_(True)
    out = compute_loss(
        LossConfig(loss_constant=2.0),
        logprobs=logprobs,
        behaviour_logprobs=b.behaviour_logprobs,
        advantages=b.advantages,
        mask=b.mask,
    )
    out.loss.backward()
    assert logprobs.grad is not None
    assert float(out.loss.detach()) == pytest.approx(0.5)
    assert out.metrics["tokens"] == 4
    assert logprobs.grad.tolist() == [[0, 0, -0.25, -0.25, 0], [0, 0.5, 0, 0, 0.5]]


def test_token_logprobs_hand_computed() -> None:
    # logits (0, ln 3): softmax (1/4, 3/4)
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])
    targets = torch.tensor([[1, 0]])
    assert close(token_logprobs(logits, targets), [[math.log(0.75), math.log(0.25)]])
    # temperature 0.5 doubles the logits: (0, 2 ln 3) -> softmax (1/10, 9/10)
    assert close(token_logprobs(logits, targets, temperature=0.5), [[math.log(0.9), math.log(0.1)]])


def test_token_logprobs_is_stable_for_large_logits_and_returns_float32() -> None:
    logits = torch.tensor([[[1000.0, 1000.0], [8192.0, 0.0]]], dtype=torch.bfloat16)  # both exact in bf16
    out = token_logprobs(logits, torch.tensor([[0, 1]]))
    assert out.dtype == torch.float32
    assert close(out, [[math.log(0.5), -8192.0]], atol=1e-4)  # float32 resolution at magnitude 1e3


def test_token_logprobs_matches_log_softmax_on_the_shifted_logits() -> None:
    gen = torch.Generator().manual_seed(0)
    b = pack_batch([SHORT, LONG])
    logits = torch.randn(2, 6, 50, generator=gen)
    got = token_logprobs(logits[:, :-1], b.targets)
    want = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, b.targets.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(got, want, atol=1e-5), "seed 0"
    assert got.shape == b.mask.shape


def test_token_logprobs_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="does not match targets shape"):
        token_logprobs(torch.zeros(2, 5, 8), torch.zeros(2, 4, dtype=torch.int64))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(1, 2, 3), torch.zeros(1, 2, dtype=torch.int64), temperature=0.0)


def item(**changes: object) -> TrainItem:
    fields = {
        "token_ids": [1, 2, 3, 4],
        "prompt_len": 2,
        "behaviour_logprobs": [-0.1, -0.2],
        "loss_mask": [1, 1],
        "advantage": 1.0,
    }
    fields.update(changes)
    return TrainItem(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"behaviour_logprobs": [-0.1]}, r"item 1: 1 behaviour_logprobs for 2 completion tokens"),
        ({"loss_mask": [1, 1, 1]}, r"item 1: loss_mask has 3 entries for 2 completion tokens"),
        ({"prompt_len": 0}, r"item 1: prompt_len must be >= 1"),
        ({"prompt_len": 4, "behaviour_logprobs": [], "loss_mask": []}, r"item 1: no completion tokens"),
        ({"loss_mask": [1, 2]}, r"item 1: loss_mask entries must be 0 or 1"),
        ({"behaviour_logprobs": [-0.1, float("nan")]}, r"item 1: behaviour_logprobs of trained tokens"),
        ({"advantage": float("inf")}, r"item 1: advantage must be finite"),
    ],
)
def test_pack_batch_rejects_malformed_items_naming_the_item(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        pack_batch([item(), item(**changes)])


def test_untrained_observation_may_carry_a_placeholder_logprob() -> None:
    b = pack_batch([item(behaviour_logprobs=[float("nan"), -0.2], loss_mask=[0, 1])])
    assert b.mask.tolist() == [[False, False, True]]
    assert close(b.behaviour_logprobs, [[0.0, 0.0, -0.2]])


def test_pack_batch_needs_items() -> None:
    with pytest.raises(ValueError, match="at least one item"):
        pack_batch([])


def test_batch_to_keeps_values() -> None:
    b = pack_batch([SHORT, LONG])
    moved = b.to("cpu")
    assert torch.equal(moved.input_ids, b.input_ids) and torch.equal(moved.mask, b.mask)
