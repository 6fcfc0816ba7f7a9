"""The optimizer step: groups of scored episodes in, one AdamW update of the policy out.

The reward each episode trains with is its scored reward re-weighted by `[learner]
reward_schedule` at the step being trained (`slipstream.rl.schedule`; the step is the count of
steps already taken, so λ needs no state of its own). Per group,
`slipstream.rl.credit.group_rows` gives every trainable sample of every episode its
agent's advantage (reward − the agent's group mean) and its loss weight, as a `TrainItem`
(frozen samples produce none); items are packed into micro-batches (`micro_batch`
trajectories per forward, sorted by length so padding stays small), log-probs are recomputed
under the workers' sampling temperature, and `compute_loss` (grpo or cispo, with the
behaviour-policy correction) is backpropagated per micro-batch. Every micro-batch divides by the
whole step's normaliser, so the accumulated gradient equals the full batch's. Then the global
gradient norm is clipped and AdamW steps once: a single pass over each trajectory.

`[learner] substeps` = K > 1 repeats that K times over the same micro-batches (Context-1's 4
gradient substeps per batch): each substep recomputes the log-probs under the weights the
substeps before produced, and its ratio is still taken against the behaviour log-probs the
workers recorded, so later substeps are corrected for their own drift as well. K = 1 (the
default) is the single update above, unchanged. The step's figures are the first substep's
(before any update: its `behaviour_kl` is the train–inference mismatch itself), with the last
substep's ratio, clip and mask figures as `last_*`.

With `[loss] kl_coef > 0` each micro-batch also runs a no-grad forward pass of the frozen
reference (`reference.py`: the initial weights; with LoRA the base model, adapters off) for the
KL penalty; its log-probs are computed once per step and reused by later substeps.

A mixture-of-experts policy (slipstream.engine.moe) adds its load-balancing loss, weighted by
`[learner] moe_aux_coef` and by each micro-batch's share of the step's trained tokens, and reports
it as `moe_aux_loss`; with `[learner] router_replay` its forward uses the experts the engine
recorded for each token (`Batch.routes`) instead of choosing its own.

A step whose gradient is not finite is not applied (the optimizer state stays as it was) and is
reported as such; the caller decides what to do with its trajectories. This module runs in a
worker thread (the service's event loop keeps draining NATS meanwhile) and does no I/O.
"""

from __future__ import annotations

import contextlib
import math
import time
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import msgspec
import torch
import torch.nn.functional as F
from torch import nn

from slipstream.engine.kernels import upcast_bf16_default
from slipstream.engine.model import CausalLM
from slipstream.engine.moe import aux_loss, force_routes
from slipstream.engine.mtp_distill import distill_loss
from slipstream.learner.config import AutocastDtype, LearnerSection
from slipstream.learner.reference import Reference, make_reference
from slipstream.rl import LossConfig, TrainItem, compute_loss, pack_batch, staleness, token_logprobs, turn_mismatch
from slipstream.rl.batch import Batch
from slipstream.rl.credit import SampleWeighting, episode_figures, episode_means, group_rows
from slipstream.rl.schedule import missing_components, reweighted, weights_at
from slipstream.schemas import ScoredEpisode

# Loss figures averaged over trained tokens across micro-batches (the rest are summed or min/max'ed).
_TOKEN_MEANS = (
    "ratio_mean",
    "clip_fraction",
    "behaviour_kl",
    "kl",
    "masked_share",
    "mtp_kl",
    "last_ratio_mean",
    "last_clip_fraction",
    "last_behaviour_kl",
    "last_masked_share",
    "moe_aux_loss",
)
_LAST = ("ratio_mean", "clip_fraction", "behaviour_kl", "masked_share")
"""Figures of the last substep reported beside the first's (as last_<name>) when substeps > 1."""


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
    reward_weights: dict[str, float] = field(default_factory=dict)
    """λ of each scheduled reward component at this step (empty without a schedule)."""
    episode_means: dict[str, float] = field(default_factory=dict)
    """Means over the step's episodes: the `step_means` counts and 'component.<name>' of every score component."""
    missing_components: dict[str, int] = field(default_factory=dict)
    """Scheduled component -> episodes of the step whose score does not name it (counted as 0)."""
    substeps: int = 1
    """Optimizer updates applied over this step's batch (`[learner] substeps`, fewer if one was not finite)."""


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


def trained_groups(
    groups: Sequence[Sequence[ScoredEpisode]], weights: Mapping[str, float]
) -> list[list[ScoredEpisode]]:
    """The groups with each episode's reward replaced by the one it trains with under `weights` (λ per component).

    Shallow copies (the episodes are shared); without weights, the groups as they are.
    """
    if not weights:
        return [list(g) for g in groups]
    return [[msgspec.structs.replace(s, reward=reweighted(s.reward, s.components, weights)) for s in g] for g in groups]


def step_items(groups: Sequence[Sequence[ScoredEpisode]], section: LearnerSection, *, step: int = 0) -> list[TrainItem]:
    """Every training row of a step's groups (advantages are per group, so they are computed here, whole),
    from the rewards re-weighted by `section.reward_schedule` at learner `step` (steps already taken)."""
    if not groups or any(not g for g in groups):
        raise ValueError("a step needs at least one group, and no group may be empty")
    weighting = section.sample_weighting
    trained = trained_groups(groups, weights_at(section.reward_schedule, step))
    return [item for g in trained for item in train_items(g, normalize_std=section.normalize_std, weighting=weighting)]


def trained_tokens(items: Sequence[TrainItem]) -> int:
    """The step's loss normaliser: trained (mask = 1) tokens over all its rows."""
    return sum(sum(item.loss_mask) for item in items)


def micro_batches(items: Sequence[TrainItem], size: int, *, count: int = 0) -> list[list[TrainItem]]:
    """`items` sorted by length (so each micro-batch's padding stays small; the summed gradient is the same)
    in chunks of `size`; with `count`, exactly that many chunks as even as possible (some may be empty)."""
    ordered = sorted(items, key=lambda item: len(item.token_ids))
    if not count:
        return [ordered[lo : lo + size] for lo in range(0, len(ordered), size)]
    if count < math.ceil(len(ordered) / size):
        raise ValueError(f"{len(ordered)} rows do not fit {count} micro-batches of at most {size}")
    base, extra = divmod(len(ordered), count)
    out: list[list[TrainItem]] = []
    lo = 0
    for i in range(count):
        n = base + (1 if i < extra else 0)
        out.append(ordered[lo : lo + n])
        lo += n
    return out


def step_stats(
    groups: Sequence[Sequence[ScoredEpisode]],
    version: int,
    items: Sequence[TrainItem],
    *,
    sums: dict[str, float],
    by_turn: dict[int, tuple[float, int]],
    grad_norm: float,
    applied: bool,
    time_s: float,
    weights: Mapping[str, float] | None = None,
    step_means: Sequence[str] = (),
    substeps: int = 1,
) -> StepStats:
    """The StepStats of a step from its loss sums (see `merge_sums`) and per-turn mismatch sums.

    `groups` are as scored (reward_mean is the scored reward's mean); `weights` are the λ the step
    trained with, `step_means` the episode counts to average.
    """
    trajectories = [s for g in groups for s in g]
    weights = dict(weights or {})
    missing: dict[str, int] = {}
    for s in trajectories:
        for name in missing_components(s.components, weights):
            missing[name] = missing.get(name, 0) + 1
    return StepStats(
        applied=applied,
        loss=sums.get("loss", 0.0),
        reward_mean=sum(s.reward for s in trajectories) / len(trajectories),
        accuracy=sum(1 for s in trajectories if s.correct) / len(trajectories),
        n_trajectories=len(trajectories),
        n_groups=len(groups),
        n_tokens=trained_tokens(items),
        grad_norm=grad_norm,
        time_s=time_s,
        staleness=staleness_histogram(trajectories, version),
        figures=_finish(sums),
        n_samples=len(items),
        episodes=episode_figures([s.episode for s in trajectories]),
        mismatch_by_turn={str(t): total / n for t, (total, n) in sorted(by_turn.items()) if n},
        reward_weights=weights,
        episode_means=episode_means(trajectories, step_means),
        missing_components=missing,
        substeps=substeps,
    )


def merge_sums(
    parts: Sequence[tuple[dict[str, float], dict[int, tuple[float, int]]]],
) -> tuple[dict[str, float], dict[int, tuple[float, int]]]:
    """Combine the loss sums and per-turn sums of several ranks' `Trainer.accumulate` into one step's."""
    sums: dict[str, float] = {}
    by_turn: dict[int, tuple[float, int]] = {}
    for part_sums, part_turns in parts:
        for name, value in part_sums.items():
            if name == "ratio_min":
                sums[name] = min(sums.get(name, math.inf), value)
            elif name == "ratio_max":
                sums[name] = max(sums.get(name, -math.inf), value)
            else:  # additive, or already token-weighted (the _TOKEN_MEANS)
                sums[name] = sums.get(name, 0.0) + value
        for turn, (total, n) in part_turns.items():
            prev = by_turn.get(turn, (0.0, 0))
            by_turn[turn] = (prev[0] + total, prev[1] + n)
    return sums, by_turn


class Trainer:
    """The policy, its AdamW optimizer, and the step that updates them: one rank's training, the whole of a
    group of one (`group.SingleRank`) or one FSDP2 rank actor's (`ranks.RankWorker`)."""

    def __init__(
        self,
        model: nn.Module,
        section: LearnerSection,
        loss: LossConfig,
        *,
        pad_id: int,
        reference: Reference | Literal["initial"] | None = "initial",
    ) -> None:
        """`reference`: the KL penalty's frozen reference; "initial" makes it from `model` as it is now
        (None without a KL penalty), None runs without one (a trainer that never steps)."""
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
        self.reference = make_reference(model, loss) if reference == "initial" else reference
        if section.mtp_distill_weight > 0 and (type(model) is not CausalLM or typing.cast(CausalLM, model).mtp is None):
            raise ValueError(
                f"[learner] mtp_distill_weight {section.mtp_distill_weight} needs a one-rank model with MTP modules "
                "(config mtp_depth > 0; `slipstream mtp-distill` makes one)"
            )

    def step(self, groups: Sequence[Sequence[ScoredEpisode]], version: int, *, step: int = 0) -> StepStats:
        """One optimizer step over `groups`, trained at policy `version` (the weights before the step) and
        learner `step` (steps already taken: it picks the reward schedule's λ)."""
        start = time.perf_counter()
        items = step_items(groups, self.section, step=step)
        total_tokens = trained_tokens(items)
        sums, by_turn, grad_norm, substeps = self.train(micro_batches(items, self.section.micro_batch), total_tokens)
        applied = substeps > 0
        return step_stats(
            groups,
            version,
            items,
            sums=sums,
            by_turn=by_turn,
            grad_norm=grad_norm,
            applied=applied,
            time_s=time.perf_counter() - start,
            weights=weights_at(self.section.reward_schedule, step),
            step_means=self.section.step_means,
            substeps=substeps,
        )

    def train(
        self, chunks: Sequence[Sequence[TrainItem]], total_tokens: int
    ) -> tuple[dict[str, float], dict[int, tuple[float, int]], float, int]:
        """The step's `[learner] substeps` updates over `chunks`: (first substep's loss sums, per-turn sums,
        first gradient norm, updates applied). A substep whose gradient is not finite is not applied and
        ends the step there; 0 applied means the weights did not change at all."""
        refs: list[torch.Tensor | None] = []
        sums, by_turn = self.accumulate(chunks, total_tokens, refs=refs)
        grad_norm, applied = self.apply()
        done = int(applied)
        last: dict[str, float] = {}
        while applied and done < self.section.substeps:
            last, _ = self.accumulate(chunks, total_tokens, refs=refs)
            _, applied = self.apply()
            done += int(applied)
        if self.section.substeps > 1:
            sums.update({f"last_{name}": last.get(name, 0.0) for name in _LAST})
        return sums, by_turn, grad_norm, done

    def accumulate(
        self,
        chunks: Sequence[Sequence[TrainItem]],
        total_tokens: int,
        *,
        refs: list[torch.Tensor | None] | None = None,
    ) -> tuple[dict[str, float], dict[int, tuple[float, int]]]:
        """Backpropagate every micro-batch of a step (gradients accumulate), each divided by the step's
        `total_tokens`. An empty chunk is a pass that adds nothing: a rank of a sharded model with fewer
        micro-batches than its peers runs it so that every rank joins every collective.

        `refs` caches the reference log-probs per chunk across substeps: empty, this call computes and
        appends them; filled, it reuses them (every rank is at the same substep, so all skip alike)."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        by_turn: dict[int, tuple[float, int]] = {}
        cached = refs is not None and len(refs) == len(chunks)
        for i, chunk in enumerate(chunks):
            ref = refs[i] if refs is not None and cached else None
            if chunk:
                figures, ref = self._backward(list(chunk), total_tokens, by_turn, ref)
                _accumulate(sums, figures)
            else:
                self._null_pass(reference=not cached)
            if refs is not None and not cached:
                refs.append(ref)
        return sums, by_turn

    def apply(self) -> tuple[float, bool]:
        """Clip the accumulated gradient and step AdamW, unless its norm is not finite: (norm, applied)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.section.grad_clip if self.section.grad_clip > 0 else math.inf
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        if hasattr(norm, "full_tensor"):  # a sharded (DTensor) model: the norm over every rank's shard
            norm = norm.full_tensor()
        grad_norm = float(norm)
        applied = math.isfinite(grad_norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, applied

    def _null_pass(self, *, reference: bool) -> None:
        ids = torch.full((1, 2), self.pad_id, dtype=torch.int64, device=self.device)
        if reference and self.reference is not None:
            # The reference pass of a real chunk is a round of collectives when it runs the sharded policy.
            with torch.no_grad(), self.reference.active() as ref_model:
                ref_model(ids)
        (self.model(ids).sum() * 0.0).backward()

    def _backward(
        self,
        chunk: list[TrainItem],
        total_tokens: int,
        by_turn: dict[int, tuple[float, int]],
        ref_logprobs: torch.Tensor | None = None,
    ) -> tuple[dict[str, float], torch.Tensor | None]:
        """One micro-batch's loss, backpropagated; returns its figures and the reference log-probs it used
        (computed here, no grad, unless given)."""
        batch = pack_batch(chunk, pad_id=self.pad_id).to(self.device)
        if self.reference is not None and ref_logprobs is None:
            with torch.no_grad(), self.reference.active() as ref_model:
                ref_logprobs = self._logprobs(ref_model, batch)
        logprobs = self._logprobs(self.model, batch, replay=self.section.router_replay)
        out = compute_loss(
            self.loss_cfg,
            logprobs=logprobs,
            behaviour_logprobs=batch.behaviour_logprobs,
            advantages=batch.advantages,
            mask=batch.mask,
            ref_logprobs=ref_logprobs,
            total_tokens=total_tokens,
        )
        loss, metrics = out.loss, out.metrics
        balance = aux_loss(self.model, batch.attention_mask)
        if balance is not None:
            # The micro-batch's share of the step's trained tokens: summed over micro-batches, a token-weighted mean.
            loss = loss + self.section.moe_aux_coef * balance * (batch.n_tokens / max(total_tokens, 1))
            metrics = {**metrics, "moe_aux_loss": float(balance.detach())}
        if self.section.mtp_distill_weight > 0:
            # The drafts learn alongside RL: their KL to the (detached) main head, weighted by this
            # micro-batch's share of the step's tokens as the RL loss is.
            kl, _ = distill_loss(typing.cast(CausalLM, self.model), batch.input_ids, batch.attention_mask)
            share = metrics.get("tokens", 0.0) / max(total_tokens, 1)
            loss = loss + self.section.mtp_distill_weight * share * kl
            metrics = {**metrics, "mtp_kl": float(kl.detach())}
        loss.backward()
        for turn, (total, n) in turn_mismatch(logprobs, batch.behaviour_logprobs, batch.mask, batch.turn_index).items():
            prev = by_turn.get(turn, (0.0, 0))
            by_turn[turn] = (prev[0] + total, prev[1] + n)
        return metrics, ref_logprobs

    def _logprobs(self, model: nn.Module, batch: Batch, *, replay: bool = False) -> torch.Tensor:
        """Per-position log-probs of `batch`'s targets under `model`, at the sampling temperature; with
        `replay`, a MoE model routes each token to the experts the engine recorded (router replay)."""
        with force_routes(model, batch.routes if replay else None):
            return self._forward_logprobs(model, batch)

    def _forward_logprobs(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        # fp32 master weights with bf16 matmuls: pure-bf16 weights lose updates below their
        # resolution (measured on SmolLM2: loss 13.566 -> 13.550 vs 13.175 with fp32 + autocast over 3 steps).
        autocast = (
            torch.autocast(self.device.type, dtype=torch.bfloat16)
            if self.autocast == "bfloat16"
            else contextlib.nullcontext()
        )
        temperature = self.section.sampling_temperature
        # A plain CausalLM only: FSDP2 (ranks > 1) swaps the class for a subclass whose forward
        # hook gathers the root's parameters, which a direct `hidden_states` call would skip.
        if type(model) is CausalLM:
            plain = typing.cast(CausalLM, model)
            # Logits only from the first trained column on: the prompt's positions need none, and
            # on search_call's one-shot prompt (~85 of ~96 tokens) the lm_head and log-softmax there were
            # a fifth of the step. The columns before `start` are masked out of every loss term.
            trained = torch.nonzero(batch.mask.any(dim=0))
            start = int(trained[0, 0]) if len(trained) else 0
            with autocast:
                hidden = plain.hidden_states(batch.input_ids, batch.attention_mask)[:, start:-1]
                logits = plain.lm_head(hidden)
            tail = token_logprobs(logits, batch.targets[:, start:], temperature=temperature)
            return F.pad(tail, (start, 0))
        with autocast:
            logits = model(batch.input_ids, batch.attention_mask)[:, :-1]
        return token_logprobs(logits, batch.targets, temperature=temperature)


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
