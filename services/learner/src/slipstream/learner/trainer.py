"""The optimizer step: groups of scored episodes in, one AdamW update of the policy out.

Per group, `slipstream.rl.credit.group_rows` gives every trainable sample of every episode its
agent's advantage (reward − the agent's group mean) and its loss weight, as a `TrainItem`
(frozen samples produce none); items are packed into micro-batches (`micro_batch`
trajectories per forward, sorted by length so padding stays small), log-probs are recomputed
under the workers' sampling temperature, and `compute_loss` (grpo or cispo, with the
behaviour-policy correction) is backpropagated per micro-batch. Every micro-batch divides by the
whole step's normaliser, so the accumulated gradient equals the full batch's. Then the global
gradient norm is clipped and AdamW steps once: a single pass over each trajectory.

A step whose gradient is not finite is not applied (the optimizer state stays as it was) and is
reported as such; the caller decides what to do with its trajectories. This module runs in a
worker thread (the service's event loop keeps draining NATS meanwhile) and does no I/O.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.engine.kernels import upcast_bf16_default
from slipstream.engine.model import CausalLM
from slipstream.learner.config import AutocastDtype, LearnerSection
from slipstream.rl import LossConfig, TrainItem, compute_loss, pack_batch, staleness, token_logprobs, turn_mismatch
from slipstream.rl.credit import SampleWeighting, episode_figures, group_rows
from slipstream.schemas import ScoredEpisode

# Loss figures averaged over trained tokens across micro-batches (the rest are summed or min/max'ed).
_TOKEN_MEANS = ("ratio_mean", "clip_fraction", "behaviour_kl", "kl")


@dataclass(frozen=True)
class StepStats:
    """What one step did, for `LearnerStep` and the metrics."""

    applied: bool
    """False when the gradient was not finite and the update was skipped."""
    loss: float
    reward_mean: float
    accuracy: float
    n_trajectories: int
    n_groups: int
    n_tokens: int
    grad_norm: float
    time_s: float
    staleness: dict[str, int] = field(default_factory=dict)
    """Versions behind (of each trajectory's oldest token) -> trajectories."""
    figures: dict[str, float] = field(default_factory=dict)
    """Loss diagnostics: ratio_mean/min/max, clip_fraction, behaviour_kl, policy_loss, ..."""
    n_samples: int = 0
    """Training rows (trainable samples with sampled tokens)."""
    episodes: dict[str, float] = field(default_factory=dict)
    """Episode shape: turns_per_episode, tool_calls_per_turn, invalid_call_rate, samples_per_episode."""
    mismatch_by_turn: dict[str, float] = field(default_factory=dict)
    """Policy-turn index -> mean (behaviour − current) log-prob of its trained tokens."""


def train_items(
    group: Sequence[ScoredEpisode], *, normalize_std: bool = False, weighting: SampleWeighting = "token"
) -> list[TrainItem]:
    """The training rows of a group: one per trainable sample, with its agent's advantage and weight."""
    return [item for rows in group_rows(group, normalize_std=normalize_std, weighting=weighting) for item in rows.items]


def staleness_histogram(episodes: Sequence[ScoredEpisode], version: int) -> dict[str, int]:
    """{versions behind: count} of the episodes' oldest trainable tokens relative to `version`."""
    hist: dict[str, int] = {}
    for s in episodes:
        lag = str(staleness(s.episode.oldest_version(), version))
        hist[lag] = hist.get(lag, 0) + 1
    return dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def effective_autocast(requested: AutocastDtype, device: torch.device) -> AutocastDtype:
    """The autocast dtype the learner runs with on `device`: `requested`, except bf16 where it is slow.

    bf16 autocast exists for speed (the weights stay fp32). On an x86 CPU without AVX-512 torch
    has no fast bf16 GEMM (the engine's `kernels.py`; the same test, `upcast_bf16_default`), and
    there a SmolLM2 learner step under bf16 autocast measured at least 4x slower than in fp32
    (16 x 150 tokens, LoRA, one thread: fp32 58 s of CPU; bf16 still running after 235 s). So
    there the learner computes in fp32: the same update up to bf16 rounding, only more precise.
    """
    if requested == "bfloat16" and upcast_bf16_default(device):
        return ""
    return requested


class Trainer:
    """The policy, its AdamW optimizer, and the step that updates them."""

    def __init__(self, model: nn.Module, section: LearnerSection, loss: LossConfig, *, pad_id: int) -> None:
        self.model = model
        self.section = section
        self.loss_cfg = loss
        self.pad_id = pad_id
        self.device = next(model.parameters()).device
        self.autocast: AutocastDtype = effective_autocast(section.autocast, self.device)
        """What forward/backward run under: `section.autocast`, or "" (fp32) where bf16 is slow."""
        # A LoRA model's base is frozen: the optimizer (and its checkpointed state) holds the adapters only.
        self.optimizer = torch.optim.AdamW(
            [p for p in model.parameters() if p.requires_grad],
            lr=section.lr,
            betas=section.betas,
            eps=section.adam_eps,
            weight_decay=section.weight_decay,
        )

    def step(self, groups: Sequence[Sequence[ScoredEpisode]], version: int) -> StepStats:
        """One optimizer step over `groups`, trained at policy `version` (the weights before the step)."""
        if not groups or any(not g for g in groups):
            raise ValueError("a step needs at least one group, and no group may be empty")
        start = time.perf_counter()
        trajectories = [s for g in groups for s in g]
        weighting = self.section.sample_weighting
        items = [
            item
            for g in groups
            for item in train_items(g, normalize_std=self.section.normalize_std, weighting=weighting)
        ]
        total_tokens = sum(sum(item.loss_mask) for item in items)
        # Sorting by length keeps each micro-batch's padding small; the summed gradient is the same.
        order = sorted(range(len(items)), key=lambda i: len(items[i].token_ids))
        size = self.section.micro_batch
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        by_turn: dict[int, tuple[float, int]] = {}
        for lo in range(0, len(order), size):
            chunk = [items[i] for i in order[lo : lo + size]]
            figures = self._backward(chunk, total_tokens, by_turn)
            _accumulate(sums, figures)
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.section.grad_clip if self.section.grad_clip > 0 else math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        applied = math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepStats(
            applied=applied,
            loss=sums.get("loss", 0.0),
            reward_mean=sum(s.reward for s in trajectories) / len(trajectories),
            accuracy=sum(1 for s in trajectories if s.correct) / len(trajectories),
            n_trajectories=len(trajectories),
            n_groups=len(groups),
            n_tokens=total_tokens,
            grad_norm=grad_norm,
            time_s=time.perf_counter() - start,
            staleness=staleness_histogram(trajectories, version),
            figures=_finish(sums),
            n_samples=len(items),
            episodes=episode_figures([s.episode for s in trajectories]),
            mismatch_by_turn={str(t): total / n for t, (total, n) in sorted(by_turn.items()) if n},
        )

    def _backward(
        self, chunk: list[TrainItem], total_tokens: int, by_turn: dict[int, tuple[float, int]]
    ) -> dict[str, float]:
        batch = pack_batch(chunk, pad_id=self.pad_id).to(self.device)
        # fp32 master weights with bf16 matmuls: pure-bf16 weights lose updates below their
        # resolution (measured on SmolLM2: loss 13.566 -> 13.550 vs 13.175 with fp32 + autocast over 3 steps).
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.autocast == "bfloat16"
            else contextlib.nullcontext()
        )
        temperature = self.section.sampling_temperature
        if isinstance(self.model, CausalLM):
            # Logits only from the first trained column on: the prompt's positions need none, and
            # on search_call's one-shot prompt (~85 of ~96 tokens) the lm_head and log-softmax there were
            # a fifth of the step. The columns before `start` are masked out of every loss term.
            trained = torch.nonzero(batch.mask.any(dim=0))
            start = int(trained[0, 0]) if len(trained) else 0
            with autocast:
                hidden = self.model.hidden_states(batch.input_ids, batch.attention_mask)[:, start:-1]
                logits = self.model.lm_head(hidden)
            tail = token_logprobs(logits, batch.targets[:, start:], temperature=temperature)
            logprobs = F.pad(tail, (start, 0))
        else:
            with autocast:
                logits = self.model(batch.input_ids, batch.attention_mask)[:, :-1]
            logprobs = token_logprobs(logits, batch.targets, temperature=temperature)
        out = compute_loss(
            self.loss_cfg,
            logprobs=logprobs,
            behaviour_logprobs=batch.behaviour_logprobs,
            advantages=batch.advantages,
            mask=batch.mask,
            total_tokens=total_tokens,
        )
        out.loss.backward()
        for turn, (total, n) in turn_mismatch(logprobs, batch.behaviour_logprobs, batch.mask, batch.turn_index).items():
            prev = by_turn.get(turn, (0.0, 0))
            by_turn[turn] = (prev[0] + total, prev[1] + n)
        return out.metrics


def _accumulate(sums: dict[str, float], figures: dict[str, float]) -> None:
    tokens = figures.get("tokens", 0.0)
    for name, value in figures.items():
        if name in _TOKEN_MEANS:
            sums[name] = sums.get(name, 0.0) + value * tokens
        elif name == "ratio_min":
            sums[name] = min(sums.get(name, math.inf), value)
        elif name == "ratio_max":
            sums[name] = max(sums.get(name, -math.inf), value)
        else:  # loss, policy_loss, kl_loss, tokens: additive over micro-batches
            sums[name] = sums.get(name, 0.0) + value


def _finish(sums: dict[str, float]) -> dict[str, float]:
    tokens = max(sums.get("tokens", 0.0), 1.0)
    return {name: (value / tokens if name in _TOKEN_MEANS else value) for name, value in sums.items()}
