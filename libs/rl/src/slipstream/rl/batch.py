"""Padded training batches: from per-trajectory token lists to aligned [B, T] tensors.

A causal LM predicts token j+1 from positions <= j, so every per-token quantity the loss needs
lives on the *prediction* axis of length T−1: position j holds the prediction of input token
j+1. For a trajectory with prompt length P, completion token k (0-based) is input token P+k and is
predicted at position P+k−1; the first completion token is therefore predicted from the last
prompt position P−1. Sequences are right-padded.

    logits = model(batch.input_ids).logits[:, :-1]          # [B, T-1, V]
    logprobs = token_logprobs(logits, batch.targets)        # [B, T-1]
    compute_loss(cfg, logprobs=logprobs, behaviour_logprobs=batch.behaviour_logprobs,
                 advantages=batch.advantages, mask=batch.mask)

A mixture-of-experts sampler's recorded routes (router replay) sit on the *input* axis instead:
`routes[b, j]` are the experts input token j was routed to, −1 where none were recorded.

This module does not know the wire schema: `credit.py` turns each trainable sample of an episode
(plus its agent's group advantage and its loss weight) into a TrainItem.

A row's loss weight w is folded into its advantage (`advantages` holds A·w): both registered
losses are positively homogeneous in the advantage (grpo: −min(r·A, clip(r)·A); cispo:
sg(clip(r))·A·log π), so a term computed with A·w is exactly w times the term with A. The
optional KL penalty and the `tokens` normaliser's token count are not weighted.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class TrainItem:
    """One trajectory ready for training; lengths are checked by `pack_batch`."""

    token_ids: Sequence[int]
    """Prompt followed by completion token ids."""
    prompt_len: int
    """Number of prompt tokens at the start of token_ids (>= 1: the first completion token needs context)."""
    behaviour_logprobs: Sequence[float]
    """log π_behaviour of each completion token, recorded at sampling time."""
    loss_mask: Sequence[int]
    """Per completion token: 1 = trained (policy output), 0 = observation, tool output, frozen sub-agent."""
    advantage: float
    """The trajectory's group advantage, broadcast to every completion token."""
    loss_weight: float = 1.0
    """Multiplies this row's policy-loss terms (see slipstream.rl.credit for the weighting)."""
    turn_index: Sequence[int] = ()
    """Optional, per completion token: the episode's policy-turn index that sampled it, −1 elsewhere."""
    routes: bytes = b""
    """Optional, MoE models: the sampler's experts for the first N tokens, uint8 [token, layer, k] (router replay)."""
    routes_per_token: int = 0
    """Entries of `routes` per token (layers × k); 0 without routes."""


@dataclass(frozen=True)
class Batch:
    """Right-padded tensors for B trajectories of at most T tokens."""

    input_ids: Tensor
    """[B, T] int64, prompt + completion, padded with pad_id."""
    attention_mask: Tensor
    """[B, T] bool, True on real tokens."""
    targets: Tensor
    """[B, T-1] int64, input_ids[:, 1:]: the token predicted at each position."""
    mask: Tensor
    """[B, T-1] bool, True where the target is a trained completion token."""
    behaviour_logprobs: Tensor
    """[B, T-1] float32, behaviour log-prob of each target completion token, 0 elsewhere."""
    advantages: Tensor
    """[B, T-1] float32, advantage × loss weight on the row's completion positions, 0 elsewhere."""
    lengths: Tensor
    """[B] int64, real token count of each sequence."""
    turn_index: Tensor
    """[B, T-1] int64, the policy-turn index of each target token (−1: none / not given)."""
    routes: Tensor | None = None
    """[B, T, layers × k] int64, the sampler's experts per input token (−1: not recorded); None when no
    item carries routes (slipstream.engine.moe.force_routes replays them)."""

    @property
    def n_tokens(self) -> int:
        """Trained tokens in the batch (the mask's sum)."""
        return int(self.mask.sum())

    def to(self, device: torch.device | str) -> Batch:
        """The same batch on `device`."""
        return Batch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            targets=self.targets.to(device),
            mask=self.mask.to(device),
            behaviour_logprobs=self.behaviour_logprobs.to(device),
            advantages=self.advantages.to(device),
            lengths=self.lengths.to(device),
            turn_index=self.turn_index.to(device),
            routes=None if self.routes is None else self.routes.to(device),
        )


def _check_item(index: int, item: TrainItem, behaviour: Tensor, loss_mask: Tensor) -> None:
    n_total = len(item.token_ids)
    where = f"item {index}"
    if item.prompt_len < 1:
        raise ValueError(f"{where}: prompt_len must be >= 1, got {item.prompt_len}")
    completion = n_total - item.prompt_len
    if completion < 1:
        raise ValueError(f"{where}: no completion tokens ({n_total} token ids, prompt_len {item.prompt_len})")
    if behaviour.numel() != completion:
        raise ValueError(
            f"{where}: {behaviour.numel()} behaviour_logprobs for {completion} completion tokens "
            f"({n_total} token ids, prompt_len {item.prompt_len})"
        )
    if loss_mask.numel() != completion:
        raise ValueError(f"{where}: loss_mask has {loss_mask.numel()} entries for {completion} completion tokens")
    if bool(((loss_mask != 0) & (loss_mask != 1)).any()):
        raise ValueError(f"{where}: loss_mask entries must be 0 or 1")
    if not bool(torch.isfinite(behaviour[loss_mask == 1]).all()):
        raise ValueError(f"{where}: behaviour_logprobs of trained tokens must be finite")
    if not math.isfinite(item.advantage):
        raise ValueError(f"{where}: advantage must be finite, got {item.advantage}")
    if not math.isfinite(item.loss_weight) or item.loss_weight < 0:
        raise ValueError(f"{where}: loss_weight must be finite and >= 0, got {item.loss_weight}")
    if item.turn_index and len(item.turn_index) != completion:
        raise ValueError(f"{where}: turn_index has {len(item.turn_index)} entries for {completion} completion tokens")
    if item.routes and (item.routes_per_token < 1 or len(item.routes) % item.routes_per_token):
        raise ValueError(f"{where}: {len(item.routes)} route bytes are not whole tokens of {item.routes_per_token}")
    if item.routes and len(item.routes) // item.routes_per_token > n_total:
        raise ValueError(f"{where}: routes for {len(item.routes) // item.routes_per_token} tokens, {n_total} tokens")


def pack_batch(items: Sequence[TrainItem], pad_id: int = 0) -> Batch:
    """Right-pad `items` into one Batch aligned for next-token prediction (see the module docstring)."""
    if not items:
        raise ValueError("pack_batch needs at least one item")
    width = max(len(item.token_ids) for item in items)
    n = len(items)
    input_ids = torch.full((n, width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((n, width), dtype=torch.bool)
    mask = torch.zeros((n, width - 1), dtype=torch.bool)
    behaviour_logprobs = torch.zeros((n, width - 1), dtype=torch.float32)
    advantages = torch.zeros((n, width - 1), dtype=torch.float32)
    lengths = torch.zeros(n, dtype=torch.int64)
    turn_index = torch.full((n, width - 1), -1, dtype=torch.int64)
    widths = {item.routes_per_token for item in items if item.routes}
    if len(widths) > 1:
        raise ValueError(f"pack_batch: items carry routes of different widths {sorted(widths)}")
    routes = torch.full((n, width, widths.pop()), -1, dtype=torch.int64) if widths else None
    for i, item in enumerate(items):
        behaviour = torch.as_tensor(item.behaviour_logprobs, dtype=torch.float32).reshape(-1)
        loss_mask = torch.as_tensor(item.loss_mask, dtype=torch.int64).reshape(-1)
        _check_item(i, item, behaviour, loss_mask)
        length = len(item.token_ids)
        input_ids[i, :length] = torch.as_tensor(item.token_ids, dtype=torch.int64)
        attention_mask[i, :length] = True
        lengths[i] = length
        # Completion token k sits at input index prompt_len + k and is predicted at prompt_len + k - 1.
        span = slice(item.prompt_len - 1, length - 1)
        mask[i, span] = loss_mask == 1
        behaviour_logprobs[i, span] = torch.where(loss_mask == 1, behaviour, 0.0)
        advantages[i, span] = item.advantage * item.loss_weight
        if item.turn_index:
            turn_index[i, span] = torch.as_tensor(item.turn_index, dtype=torch.int64)
        if routes is not None and item.routes:
            recorded = torch.frombuffer(bytearray(item.routes), dtype=torch.uint8).view(-1, routes.shape[-1])
            routes[i, : recorded.shape[0]] = recorded.to(torch.int64)
    return Batch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        targets=input_ids[:, 1:].clone(),
        mask=mask,
        behaviour_logprobs=behaviour_logprobs,
        advantages=advantages,
        lengths=lengths,
        turn_index=turn_index,
        routes=routes,
    )


def turn_mismatch(
    logprobs: Tensor, behaviour_logprobs: Tensor, mask: Tensor, turn_index: Tensor
) -> dict[int, tuple[float, int]]:
    """{turn: (Σ (behaviour − current) log-prob, trained tokens)} over trained tokens with a turn index.

    The mean per turn (sum / count) is the behaviour-vs-current mismatch of that turn: 0 when the
    learner reproduces the sampler exactly; growing with the turn index when boundary tokens or
    re-rendered history drift (verl #5229's per-round diff). Sums, so micro-batches add up.
    """
    keep = (mask != 0) & (turn_index >= 0)
    if not bool(keep.any()):
        return {}
    diff = (behaviour_logprobs.detach().float() - logprobs.detach().float())[keep]
    turns = turn_index[keep]
    out: dict[int, tuple[float, int]] = {}
    for t in torch.unique(turns).tolist():
        sel = turns == t
        out[int(t)] = (float(diff[sel].sum()), int(sel.sum()))
    return out


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0) -> Tensor:
    """log softmax(logits / temperature)[target] per position: [..., V] x [...] -> [...], float32.

    Computed as logit[target] − logsumexp(logits) in float32, which is stable for large logits
    and never materialises the full log-softmax. `temperature` must match the sampling temperature,
    or the ratio against the behaviour log-probs is biased from the first step.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits shape {tuple(logits.shape)} does not match targets shape {tuple(targets.shape)} (+ vocab axis)"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    scaled = logits.float()
    if temperature != 1.0:
        scaled = scaled / temperature
    picked = scaled.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(scaled, dim=-1)
