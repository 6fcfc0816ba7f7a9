"""Batched token sampling with per-row parameters and per-request random streams.

`process_logits` turns raw logits into the log-probabilities of the distribution actually
sampled from (temperature, then top-k, then top-p, renormalised); the log-prob recorded for a
sampled token is read from that same tensor, which is what the learner's importance ratio needs
(vLLM's "processed_logprobs"). Greedy rows (temperature 0) take the argmax and report the
log-prob under the raw logits (temperature 1, no filtering): the point mass actually "sampled
from" would always say 0, which tells a learner or an eval nothing.

Each row draws one uniform number from its own `torch.Generator` and inverts the CDF, so a
seeded request yields the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from slipstream.engine.interface import SamplingParams


def process_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Log-probs [B, V] after temperature, top-k and top-p; removed tokens get -inf.

    `temperature` [B] (> 0), `top_k` [B] (0 = off), `top_p` [B] (1 = off). Ties at the k-th
    value are all kept. Top-p keeps the smallest prefix of the sorted distribution whose mass
    reaches p (always at least one token).
    """
    scaled = logits.to(torch.float32) / temperature[:, None]
    vocab = scaled.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    needs_k = bool((k < vocab).any())
    needs_p = bool((top_p < 1.0).any())
    if needs_k or needs_p:
        sorted_vals, order = scaled.sort(dim=-1, descending=True)
        if needs_k:
            kth = sorted_vals.gather(1, (k - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
            sorted_vals = sorted_vals.masked_fill(sorted_vals < kth, float("-inf"))
        if needs_p:
            probs = sorted_vals.softmax(dim=-1)
            mass_before = probs.cumsum(dim=-1) - probs
            drop_sorted = mass_before >= top_p[:, None]
            drop_sorted[:, 0] = False
            drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
            scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.log_softmax(dim=-1)


def draw(lp: Tensor, u: Tensor) -> Tensor:
    """The token [B] of each row of log-probs `lp` [B, V] (-inf: excluded) at uniforms `u` [B] in [0, 1).

    Inverse-CDF sampling: the first index whose cumulative mass exceeds u times the row's total,
    so `lp` need not be normalised (speculative decoding's residual distribution is not).
    """
    cdf = lp.exp().cumsum(dim=-1)
    target = (u * cdf[:, -1])[:, None]
    # First index whose cumulative mass exceeds the target: never a zero-probability token,
    # except by rounding at the very top (past the last kept token, or past the end), which
    # the cap to the last kept token covers. The cap scans the whole vocabulary, so it runs
    # only for the rare rows that need it (a decode step spent ~4% of its time there).
    vocab = lp.shape[-1]
    picked = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1)
    stray = torch.isneginf(lp.gather(1, picked)[:, 0]) | (picked[:, 0] == vocab - 1)
    if bool(stray.any()):
        vocab_idx = torch.arange(vocab, device=lp.device)
        last_kept = (torch.isfinite(lp[stray]) * vocab_idx).argmax(dim=-1, keepdim=True)
        picked[stray] = torch.minimum(picked[stray], last_kept)
    return picked[:, 0]


def row_params(params: Sequence[SamplingParams], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Per-row temperature, top-k and top-p [B] for `process_logits`; a greedy row gets temperature 1
    and no filters, so its processed log-probs are the raw logits' log-softmax (which it records)."""
    temp = torch.tensor([p.temperature if p.temperature > 0.0 else 1.0 for p in params], device=device)
    top_k = torch.tensor([0 if p.temperature == 0.0 else p.top_k for p in params], device=device)
    top_p = torch.tensor([1.0 if p.temperature == 0.0 else p.top_p for p in params], device=device)
    return temp, top_k, top_p


def row_logprobs(logits: Tensor, params: Sequence[SamplingParams]) -> Tensor:
    """Log-probs [B, V] each row samples from and records (see the module docstring): processed by
    the row's temperature, top-k and top-p, or, for a greedy row, the raw logits' log-softmax
    (whose argmax is the greedy token)."""
    if len(params) != logits.shape[0]:
        raise ValueError(f"row_logprobs: {logits.shape[0]} rows but {len(params)} params")
    return process_logits(logits, *row_params(params, logits.device))


def sample(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row of `logits` [B, V], and its log-prob (see the module docstring)."""
    b = logits.shape[0]
    if len(params) != b or len(generators) != b:
        raise ValueError(f"sample: {b} rows but {len(params)} params and {len(generators)} generators")
    device = logits.device
    logits = logits.to(torch.float32)
    greedy = [p.temperature == 0.0 for p in params]
    ids = torch.empty(b, dtype=torch.long, device=device)
    logp = torch.empty(b, dtype=torch.float32, device=device)
    rows = [i for i in range(b) if not greedy[i]]
    if rows:
        sub = logits if len(rows) == b else logits[rows]
        temp = torch.tensor([params[i].temperature for i in rows], device=device)
        top_k = torch.tensor([params[i].top_k for i in rows], device=device)
        top_p = torch.tensor([params[i].top_p for i in rows], device=device)
        lp = process_logits(sub, temp, top_k, top_p)
        # One uniform per row from that row's own stream, drawn on CPU so the stream does not
        # depend on the device; inverse-CDF sampling then needs no further randomness.
        u = torch.cat([torch.rand(1, generator=generators[i]) for i in rows]).to(device)
        picked = draw(lp, u)
        picked_lp = lp.gather(1, picked[:, None])
        ids[rows] = picked
        logp[rows] = picked_lp[:, 0]
    grows = [i for i in range(b) if greedy[i]]
    if grows:
        sub = logits[grows]
        top = sub.argmax(dim=-1)
        ids[grows] = top
        logp[grows] = sub.log_softmax(dim=-1).gather(1, top[:, None])[:, 0]
    return ids.tolist(), logp.tolist()
