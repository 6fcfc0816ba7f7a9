"""Self-distillation of a model's MTP modules (`mtp.py`) from its own next-token distributions.

Module k at position t sees the main model's hidden state at t and the tokens t+1 .. t+k, and is
trained to match what the main head predicts at position t+k: the loss is KL(p_main || q_k),
averaged over the positions where both exist, summed over depths. The main model is the teacher
and stays frozen (its hidden states, embeddings and lm_head enter detached), so distillation
changes the drafts only, never the policy: speculative decoding's output distribution is the main
model's whatever the heads learn, and better heads only raise the acceptance rate.

`distill_loss` is the one loss (a learner adds it to its RL loss; `self_distill` runs it as a
separate step on token sequences, such as ones the model generated itself: `generate_corpus`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
import torch.nn.functional as F
from torch import Tensor

from slipstream.engine.engine import TorchEngine
from slipstream.engine.interface import GenerationRequest, SamplingParams
from slipstream.engine.model import CausalLM
from slipstream.engine.mtp import build_mtp, modules_of
from slipstream.engine.tokenizer import Tokenizer


def mtp_parameters(model: CausalLM) -> list[torch.nn.Parameter]:
    """The MTP modules' parameters (what distillation trains); ValueError if the model has none."""
    if model.mtp is None:
        raise ValueError("the model has no MTP modules (its config's mtp_depth is 0)")
    return list(model.mtp.parameters())


def distill_loss(
    model: CausalLM,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    hidden: Tensor | None = None,
    positions: Tensor | None = None,
    temperature: float = 1.0,
) -> tuple[Tensor, list[float]]:
    """Sum over depths of the mean KL(p_main || q_k) on `input_ids` [B, T]; also each depth's KL.

    `hidden`: the main model's final-norm hidden states [B, T, H] if the caller has them (detached
    here); otherwise computed without gradient. `attention_mask` [B, T]: 1 = token, 0 = padding.
    `positions` [P, 2]: the (row, t) starting points to train on (a sample, to bound a step's cost
    on a large vocabulary); None takes every position. Depth k at t counts where t and t+k are
    both real tokens.
    """
    modules = modules_of(model.mtp)
    if not modules:
        raise ValueError("distill_loss: the model has no MTP modules (its config's mtp_depth is 0)")
    if temperature <= 0:
        raise ValueError(f"distill_loss: temperature must be > 0, got {temperature}")
    b, t = input_ids.shape
    device = input_ids.device
    valid = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    head = model.lm_head.weight.detach()
    if positions is None:
        grid = torch.cartesian_prod(torch.arange(b, device=device), torch.arange(max(t - 1, 0), device=device))
        positions = grid.reshape(-1, 2)
    rows, starts = positions[:, 0], positions[:, 1]
    with torch.no_grad():
        if hidden is None:
            hidden = model.hidden_states(input_ids, attention_mask)
        hidden = hidden.detach()
    x = hidden[rows, starts]
    total = torch.zeros((), device=device)
    per_depth: list[float] = []
    for k, module in enumerate(modules, start=1):
        ahead = (starts + k).clamp(max=t - 1)
        ok = (starts + k < t) & valid[rows, starts] & valid[rows, ahead]
        if not bool(ok.any()):
            break
        with torch.no_grad():
            embeds = model.model.embed_tokens(input_ids[rows, ahead])
            teacher = F.log_softmax(F.linear(hidden[rows, ahead], head).float() / temperature, dim=-1)
        # Depth k at t: x_{k-1} at t and the token at t+k in, the teacher's distribution at t+k out.
        x = module(x, embeds)
        student = F.log_softmax(F.linear(module.head_input(x), head).float() / temperature, dim=-1)
        kl = (teacher.exp() * (teacher - student)).sum(dim=-1)
        depth_kl = (kl * ok).sum() / ok.sum()
        total = total + depth_kl
        per_depth.append(float(depth_kl.detach()))
    return total, per_depth


def sample_positions(attention_mask: Tensor, count: int, generator: torch.Generator) -> Tensor:
    """`count` (row, t) pairs [count, 2], uniformly among the positions whose next token is real."""
    valid = attention_mask.bool()
    usable = torch.nonzero(valid[:, :-1] & valid[:, 1:])
    if len(usable) <= count:
        return usable
    pick = torch.randperm(len(usable), generator=generator)[:count].to(usable.device)
    return usable[pick]


def _batches(
    sequences: Sequence[Sequence[int]], size: int, pad_id: int, device: torch.device
) -> list[tuple[Tensor, Tensor]]:
    out = []
    for i in range(0, len(sequences), size):
        chunk = sequences[i : i + size]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for r, seq in enumerate(chunk):
            ids[r, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
            mask[r, : len(seq)] = 1
        out.append((ids.to(device), mask.to(device)))
    return out


def held_out_kl(
    model: CausalLM, sequences: Sequence[Sequence[int]], *, pad_id: int = 0, batch_size: int = 16
) -> list[float]:
    """Each depth's KL(p_main || q_k), token-weighted over `sequences` (no training)."""
    device = model.lm_head.weight.device
    sums: list[float] = []
    weights: list[float] = []
    with torch.no_grad():
        for ids, mask in _batches(sequences, batch_size, pad_id, device):
            _, per_depth = distill_loss(model, ids, mask)
            for k, value in enumerate(per_depth, start=1):
                n = float((mask[:, :-k].bool() & mask[:, k:].bool()).sum())
                if len(sums) < k:
                    sums.append(0.0)
                    weights.append(0.0)
                sums[k - 1] += value * n
                weights[k - 1] += n
    return [s / w if w else 0.0 for s, w in zip(sums, weights, strict=True)]


def self_distill(
    model: CausalLM,
    sequences: Sequence[Sequence[int]],
    *,
    steps: int,
    lr: float = 3e-3,
    batch_size: int = 16,
    positions_per_step: int = 0,
    pad_id: int = 0,
    seed: int = 0,
) -> list[float]:
    """Train the MTP modules alone for `steps` AdamW steps on `sequences` (shuffled, seeded);
    returns each step's loss. The rest of the model is left exactly as it was.
    `positions_per_step` > 0 trains each step on that many positions drawn from its batch.

    The main model is frozen, so its hidden states are computed once per sequence, up front, and
    each step runs only the modules and the lm_head (a 135M model's step on CPU drops from a full
    forward to a fraction of one).
    """
    if steps < 0 or batch_size < 1:
        raise ValueError(f"self_distill: steps must be >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    if not sequences:
        raise ValueError("self_distill: no sequences to distill on")
    params = mtp_parameters(model)
    device = model.lm_head.weight.device
    was_training = model.training
    model.eval()
    ids_all, mask_all, hidden_all = [], [], []
    with torch.no_grad():
        for ids, mask in _batches(sequences, batch_size, pad_id, device):
            ids_all += list(ids)
            mask_all += list(mask)
            hidden_all += list(model.hidden_states(ids, mask))
    model.train()
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(seed)
    losses: list[float] = []
    order: list[int] = []
    try:
        while len(losses) < steps:
            if len(order) < batch_size:
                order += torch.randperm(len(sequences), generator=gen).tolist()
            picked, order = order[:batch_size], order[batch_size:]
            width = max(len(sequences[i]) for i in picked)
            ids = torch.stack([_fit(ids_all[i], width, pad_id) for i in picked])
            mask = torch.stack([_fit(mask_all[i], width, 0) for i in picked])
            hidden = torch.stack([_fit(hidden_all[i], width, 0) for i in picked])
            sampled = sample_positions(mask, positions_per_step, gen) if positions_per_step > 0 else None
            loss, _ = distill_loss(model, ids, mask, hidden=hidden, positions=sampled)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        opt.zero_grad(set_to_none=True)
        model.train(was_training)
    return losses


def _fit(row: Tensor, width: int, fill: float) -> Tensor:
    """`row` cut or padded (with `fill`) to `width` along its first dimension."""
    if row.shape[0] >= width:
        return row[:width]
    pad = row.new_full((width - row.shape[0], *row.shape[1:]), fill)
    return torch.cat([row, pad])


def attach_mtp(model: CausalLM, depth: int, *, seed: int = 0) -> CausalLM:
    """Give `model` `depth` freshly initialised MTP modules (replacing any it has), on its device and
    dtype, and a config that says so (so saving and loading keep them). Returns the model."""
    if depth < 1:
        raise ValueError(f"attach_mtp: depth must be >= 1, got {depth}")
    ref = model.lm_head.weight
    model.config = msgspec.structs.replace(model.config, mtp_depth=depth)
    mtp = build_mtp(model.config)
    assert mtp is not None
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in mtp.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.mtp = mtp.to(device=ref.device, dtype=ref.dtype)
    return model


def generate_corpus(
    model: CausalLM,
    tokenizer: Tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    samples_per_prompt: int = 4,
    max_tokens: int = 64,
    temperature: float = 1.0,
    seed: int = 0,
    max_batch: int = 32,
    device: str | torch.device | None = None,
) -> list[list[int]]:
    """Prompt + completion token ids of samples the model itself generates (a distillation corpus)."""
    dtype = model.lm_head.weight.dtype
    longest = max(len(p) for p in prompts)
    engine = TorchEngine(
        model,
        tokenizer,
        max_batch=max_batch,
        max_seq_len=longest + max_tokens + 1,
        device=device or model.lm_head.weight.device,
        dtype=dtype,
        seed=seed,
    )
    params = SamplingParams(temperature=temperature, max_tokens=max_tokens)
    for i, prompt in enumerate(prompts):
        for j in range(samples_per_prompt):
            engine.submit(GenerationRequest(request_id=f"corpus/{i}/{j}", prompt_ids=list(prompt), params=params))
    results = []
    while engine.has_work:
        results += engine.step()
    results.sort(key=lambda r: r.request_id)
    return [list(r.prompt_ids) + list(r.completion_ids) for r in results]


def distill_on_own_samples(
    model: CausalLM,
    tokenizer: Tokenizer,
    corpus_prompts: Sequence[Sequence[int]],
    held_prompts: Sequence[Sequence[int]],
    *,
    depth: int,
    steps: int = 300,
    lr: float = 3e-3,
    batch_size: int = 16,
    positions_per_step: int = 0,
    samples_per_prompt: int = 4,
    max_tokens: int = 96,
    seed: int = 0,
) -> dict[str, Any]:
    """The whole separate step: give `model` `depth` MTP modules if it has fewer, sample a corpus
    from it (`corpus_prompts`, temperature 1) and a held-out set (`held_prompts`, one sample each),
    self-distil the modules, and report the held-out KL per depth before and after."""
    if not corpus_prompts or not held_prompts:
        raise ValueError("distill_on_own_samples: needs corpus prompts and held-out prompts")
    fresh = len(modules_of(model.mtp)) < depth
    if fresh:
        attach_mtp(model, depth, seed=seed)
    device = model.lm_head.weight.device
    t0 = time.perf_counter()
    corpus = generate_corpus(
        model,
        tokenizer,
        corpus_prompts,
        samples_per_prompt=samples_per_prompt,
        max_tokens=max_tokens,
        seed=seed,
        max_batch=min(64, len(corpus_prompts) * samples_per_prompt),
        device=device,
    )
    held = generate_corpus(
        model,
        tokenizer,
        held_prompts,
        samples_per_prompt=1,
        max_tokens=max_tokens,
        seed=seed + 1,
        max_batch=min(64, len(held_prompts)),
        device=device,
    )
    corpus_s = time.perf_counter() - t0
    before = held_out_kl(model, held, batch_size=batch_size)
    t0 = time.perf_counter()
    losses = self_distill(
        model, corpus, steps=steps, lr=lr, batch_size=batch_size, positions_per_step=positions_per_step, seed=seed
    )
    distill_s = time.perf_counter() - t0
    after = held_out_kl(model, held, batch_size=batch_size)
    model.eval()
    return {
        "depth": depth,
        "mtp_fresh": fresh,
        "steps": steps,
        "lr": lr,
        "batch": batch_size,
        "positions_per_step": positions_per_step,
        "corpus_sequences": len(corpus),
        "corpus_tokens": sum(len(s) for s in corpus),
        "held_out_sequences": len(held),
        "held_out_kl_before": before,
        "held_out_kl_after": after,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "corpus_s": round(corpus_s, 2),
        "distill_s": round(distill_s, 2),
    }
